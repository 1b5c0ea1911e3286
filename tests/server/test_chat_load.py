"""The serving API under memory and load limits: cartridges evicted least recently used first
under the memory budget, one too large refused clearly; 32 streaming clients for 30 s with
others disconnecting mid-stream, on a live server with a tiny model."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from cartridges import Client

from .conftest import API_KEY, LiveServer, upload_text
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # tiny model: layers × (K, V) × KV heads × head dim × float32
BUDGET_MIB = 0.16  # two cartridges of 300 tokens fit, a third does not; one of 700 never does


@pytest.fixture(scope="module")
def small_memory_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("memory") / "data", model=tiny_model_dir,
                      env={"CARTRIDGES_WORKER_THREADS": "1", "CARTRIDGES_CARTRIDGE_MEMORY_MIB": str(BUDGET_MIB)}).start()
    try:
        yield live
    finally:
        live.stop()


def train(server: LiveServer, key: str, file_id: str, num_tokens: int) -> str:
    with Client(server.url, key) as client:
        # one cartridge of `num_tokens`, though the corpus holds more than four of the tiny model's contexts
        block = client.datablocks.train([file_id], config={**TINY_TRAIN_CONFIG, "num_tokens": num_tokens},
                                        parts=False)
        done = client.datablocks.wait(block["id"], timeout=120, poll_interval=0.2)
        assert done["status"] == "succeeded", done["error"]
        return done["id"]


def test_memory_budget_evicts_the_least_recently_used(small_memory_server: LiveServer) -> None:
    server = small_memory_server
    key = server.add_user()
    client = server.openai(key)
    file_id = upload_text(client, DOCUMENT * 20)
    a, b, c = (train(server, key, file_id, 300) for _ in range(3))
    big = train(server, key, file_id, 700)
    assert 300 * BYTES_PER_TOKEN * 2 <= BUDGET_MIB * 2**20 < min(300 * BYTES_PER_TOKEN * 3, 700 * BYTES_PER_TOKEN)
    http = server.http(key)
    assert http.post("/preload", json=[a, b]).json() == {a: "loaded", b: "loaded"}
    chat = {"model": a, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200  # a is now the most recently used
    assert http.post("/preload", json=[c]).json() == {c: "loaded"}  # evicts b
    assert {m.id for m in client.models.list().data} == {a, c}
    answer = http.post("/preload", json=[big]).json()[big]
    assert answer.startswith("error: ") and "larger than the server's cartridge memory" in answer
    refused = http.post("/v1/chat/completions", json={**chat, "model": big})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "cartridge_too_large"
    assert {m.id for m in client.models.list().data} == {a, c}  # nothing was evicted for it
    # chatting with an evicted one loads it again (evicting the least recently used)
    assert http.post("/v1/chat/completions", json={**chat, "model": b}).status_code == 200
    assert {m.id for m in client.models.list().data} == {b, c}
    assert "cartridges_cartridge_evictions_total 2.0" in httpx.get(server.url + "/metrics").text


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def _client(url: str, body: dict, until: float, disconnect: bool, tally: dict, rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        while time.monotonic() < until:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    tally["errors"].append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                    continue
                leave_after = rng.randint(1, 6) if disconnect else None
                events, done = 0, False
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    payload = json.loads(line.removeprefix("data: "))
                    if "error" in payload:
                        tally["errors"].append(str(payload))
                        break
                    events += 1
                    if leave_after is not None and events >= leave_after:
                        break  # leave mid-stream: the server must cancel
                tally["completed" if done else "left"] += 1


def test_32_streaming_clients_and_leavers_for_30_seconds(tmp_path_factory: pytest.TempPathFactory,
                                                       tiny_model_dir) -> None:
    server = LiveServer(tmp_path_factory.mktemp("load") / "data", model=tiny_model_dir).start()
    try:
        assert server.proc is not None
        body = {"model": "", "messages": [{"role": "user", "content": "Tell me about the bells."}],
                "max_tokens": 48, "stream": True, "temperature": 0.8}
        body["model"] = httpx.get(server.url + "/v1/status").json()["model"]
        tally: dict = {"completed": 0, "left": 0, "errors": []}
        healthy: list[int] = []

        async def run(seconds: float) -> None:
            until = time.monotonic() + seconds
            rng = random.Random(0)
            clients = [_client(server.url, body, until, False, tally, rng) for _ in range(32)]
            clients += [_client(server.url, body, until, True, tally, rng) for _ in range(8)]

            async def watch_health() -> None:
                async with httpx.AsyncClient(timeout=10) as http:
                    while time.monotonic() < until:
                        healthy.append((await http.get(server.url + "/health")).status_code)
                        await asyncio.sleep(1)

            await asyncio.gather(*clients, watch_health())

        asyncio.run(run(5))  # warm up: allocator pools, first-use paths
        before = rss(server.proc.pid)
        asyncio.run(run(30))
        after = rss(server.proc.pid)
        assert tally["errors"] == []
        assert tally["completed"] > 32 and tally["left"] > 8
        assert healthy and all(code == 200 for code in healthy)
        assert after - before < 64 << 20, f"server memory grew by {(after - before) >> 20} MiB"
        deadline = time.monotonic() + 10
        while (status := httpx.get(server.url + "/v1/status").json())["engine"]["running_requests"] and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert status["engine"]["running_requests"] == 0 and status["engine"]["waiting_requests"] == 0
        assert status["engine"]["kv_tokens_used"] == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()
