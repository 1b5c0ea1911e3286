"""Live servers on loopback for the API tests: real processes, free ports, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "sk-cart-test-default-key-0123456789"
ADMIN_KEY = "sk-cart-test-admin-key-0123456789"
SMALL_LIMIT = 1 << 20  # upload limit of the shared server, so that 413 tests are fast


_open_clients: list[httpx.Client | openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Clients made by LiveServer.openai/http are closed after each test (no leaked sockets)."""
    yield
    while _open_clients:
        _open_clients.pop().close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`cartridges serve` in a subprocess on a fresh port."""

    def __init__(self, data_dir: Path, max_upload_bytes: int | None = None, *, model: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.max_upload_bytes = max_upload_bytes
        self.model = model  # base model path (--model); None: the default model
        self.env = env or {}  # extra environment, e.g. CARTRIDGES_* settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = data_dir.parent / f"{data_dir.name}-server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, healthy: bool = True) -> LiveServer:
        """Starts the server and waits until /health answers 200 (`healthy`), or answers at all."""
        self.port = free_port()
        env = dict(os.environ, CARTRIDGES_API_KEY=API_KEY, CARTRIDGES_ADMIN_KEY=ADMIN_KEY, **self.env)
        if self.max_upload_bytes is not None:
            env["CARTRIDGES_MAX_UPLOAD_BYTES"] = str(self.max_upload_bytes)
        cmd = [sys.executable, "-m", "cartridges.cli", "serve", "--port", str(self.port)]
        if self.model is not None:
            cmd += ["--model", str(self.model)]
        cmd += ["--data-dir", str(self.data_dir), "--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                # healthy: the model is loaded (it loads in the background after the port opens)
                if httpx.get(self.url + "/health", timeout=1).status_code == 200 or not healthy:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def openai(self, key: str = API_KEY, prefix: str = "/v1") -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.url + prefix, api_key=key, max_retries=0, timeout=60)
        _open_clients.append(client)
        return client

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.Client(base_url=self.url, headers=headers, timeout=60)
        _open_clients.append(client)
        return client

    def add_user(self, name: str | None = None) -> str:
        """A new user with a key, created through the store while the server runs."""
        from cartridges.server.keys import create_key
        from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV, open_store

        store = open_store(self.data_dir, database_url=self.env.get(DATABASE_URL_ENV),
                           blob_url=self.env.get(BLOB_URL_ENV))
        try:
            return create_key(store, name or f"user-{uuid.uuid4().hex[:12]}")
        finally:
            store.close()

    def blob_names(self) -> set[str]:
        return {p.name for p in (self.data_dir / "blobs").iterdir() if p.is_file()}

    def tmp_names(self) -> list[str]:
        return [p.name for p in (self.data_dir / "blobs" / "tmp").iterdir()]


def running_replicas(*replicas: LiveServer) -> Iterator[tuple[LiveServer, ...]]:
    """Starts the replicas in order for a fixture to yield; stops every one started, however
    the test ends."""
    started: list[LiveServer] = []
    try:
        for replica in replicas:
            started.append(replica)
            replica.start()
        yield tuple(replicas)
    finally:
        for replica in reversed(started):
            replica.stop()


def served_by(replica: LiveServer, key: str, datablock_id: str) -> None:
    """Waits for a datablock's job through `replica` and checks that it answers a chat with it."""
    from cartridges import Client

    with Client(replica.url, key) as client:
        done = client.datablocks.wait(datablock_id, timeout=180, poll_interval=0.2, progress=False)
    assert done["status"] == "succeeded", done
    reply = replica.openai(key).chat.completions.create(
        model=datablock_id, messages=[{"role": "user", "content": "What is in the handbook?"}],
        temperature=0, max_tokens=6)
    assert reply.choices[0].message.content is not None


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: int) -> LiveServer:
    return LiveServer(tmp_path_factory.mktemp(name) / "data", **kwargs).start()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the API tests, with 1 MiB limits on uploads and on other request bodies."""
    live = LiveServer(tmp_path_factory.mktemp("shared") / "data", SMALL_LIMIT,
                      env={"CARTRIDGES_MAX_REQUEST_BYTES": str(SMALL_LIMIT)}).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def user_key(server: LiveServer) -> str:
    """A fresh user per test: its file list starts empty."""
    return server.add_user()


def wait_processed(http: httpx.Client, file_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(f"/v1/files/{file_id}").json()
        if body["status"] != "uploaded" or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def make_pdf(text: str) -> bytes:
    """A one-page PDF whose text layer is `text` (ASCII)."""
    stream = f"BT /F1 18 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"testboundary1234") -> tuple[bytes, str]:
    """A raw multipart body from (Content-Disposition parameters, payload) pairs."""
    body = bytearray()
    for disposition, payload in parts:
        body += b"--" + boundary + b"\r\nContent-Disposition: form-data; " + disposition + b"\r\n\r\n"
        body += payload + b"\r\n"
    body += b"--" + boundary + b"--\r\n"
    return bytes(body), f"multipart/form-data; boundary={boundary.decode()}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (HF directory) that datablock jobs train on in seconds."""
    from .tiny_hf_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def upload_text(client: openai.OpenAI, text: str, name: str = "doc.txt", purpose: str = "cartridge-training") -> str:
    """Uploads through the official client; returns the file id once processed (or in error)."""
    created = client.files.create(file=(name, text.encode()), purpose=purpose)  # type: ignore[arg-type]
    deadline = time.monotonic() + 30
    while client.files.retrieve(created.id).status == "uploaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    return created.id


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[LiveServer]:
    """A live server on the tiny model, whose id is `tiny`; one per test module."""
    named = tmp_path_factory.mktemp("chat-model") / "tiny"  # the base model's id is its directory's name
    named.symlink_to(tiny_model_dir, target_is_directory=True)
    live = LiveServer(tmp_path_factory.mktemp("chat") / "data", model=named,
                      env={"CARTRIDGES_WORKER_THREADS": "1"}).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(params=["s3", "directory"])
def shared_blob_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A blob store two replicas share: a bucket of moto's S3 server (its AWS_* variables set
    for this process), or a directory both mount (file:///...)."""
    if request.param == "s3":
        return request.getfixturevalue("s3_blob_url")
    return (tmp_path / "shared blobs").as_uri()  # a space: the URL is percent-encoded
