"""`cartridges chat --server URL`: the terminal chat against a live server, through the OpenAI client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import API_KEY, LiveServer, free_port, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory, "chat-cli", model=tiny_model_dir)  # returns once /health is 200
    try:
        assert httpx.get(live.url + "/health", timeout=5).status_code == 200
        yield live
    finally:
        live.stop()


def chat(*args: str, stdin: str = "hello\n/exit\n", **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CARTRIDGES_API_KEY", "OPENAI_API_KEY")}
    env.update(env_vars)
    return subprocess.run([sys.executable, "-m", "cartridges.cli", "chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, env=env)


def test_chat_with_server_streams_a_reply(chat_server: LiveServer):
    done = chat("--server", chat_server.url, "--api-key", API_KEY, "--max-tokens", "5", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr
    assert "connected to" in done.stderr and "error" not in done.stderr


def test_reset_and_end_of_input(chat_server: LiveServer):
    """Two messages, /reset between them, and end of input (Ctrl-D) instead of /exit; a URL
    that already ends in /v1 works too, and the key comes from OPENAI_API_KEY. Greedy decoding:
    the same message after a reset gets the same reply."""
    done = chat("--server", chat_server.url + "/v1", "--max-tokens", "4", stdin="hello\n/reset\nhello\n",
                OPENAI_API_KEY=API_KEY)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0].strip(), done.stdout


def test_bad_key_exits_with_a_clear_message(chat_server: LiveServer):
    done = chat("--server", chat_server.url, "--api-key", "sk-not-a-key", "--max-tokens", "5")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: the server refused the API key (401")
    assert "Traceback" not in done.stderr and not done.stdout.strip()


def test_unknown_cartridge_exits_before_the_first_message(chat_server: LiveServer):
    done = chat("--server", chat_server.url, "--api-key", API_KEY, "--cartridge", "nobody/x/abcdefgh12")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cartridge nobody/x/abcdefgh12:"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_refused_message_is_reported_and_the_chat_goes_on(chat_server: LiveServer):
    """max_tokens past the tiny model's context: 400 for each message, and the chat goes on to
    the next line; the exit status says that a message failed."""
    done = chat("--server", chat_server.url, "--api-key", API_KEY, "--max-tokens", "100000",
                stdin="hello\nhello again\n/exit\n")
    assert done.returncode == 1
    assert done.stderr.count("error: 400 context_length_exceeded:") == 2, done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_server():
    done = chat("--server", f"http://127.0.0.1:{free_port()}", "--api-key", API_KEY)
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot reach the server at http://127.0.0.1:"), done.stderr


def test_a_server_that_drops_the_reply_midway_is_a_clear_error():
    """A server that answers the checks, then cuts the stream off after one chunk: the chat
    ends with one line saying so, what was received stays printed, and there is no traceback.
    Its /preload answering with another service's page is a clear error too."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Dropping(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.endswith("/status"):
                self._json({"status": "ok", "model": "m"})
            else:
                self._json({"object": "list", "data": []})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/preload":  # another service's page, not the map of ids
                page = b"<html>hello</html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Half a rep"},
                                  "finish_reason": None}]}
            line = f"data: {json.dumps(event)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
            self.connection.shutdown(2)  # cut off: no closing chunk, no [DONE]

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dropping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done = chat("--server", url, "--api-key", API_KEY)
        preloaded = chat("--server", url, "--api-key", API_KEY, "--cartridge", "a/b/c")
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1, done.stderr
    assert "Half a rep" in done.stdout
    assert "Traceback" not in done.stderr and "error: " in done.stderr, done.stderr
    assert preloaded.returncode == 1 and "did not answer as a cartridges server does" in preloaded.stderr, \
        preloaded.stderr
