"""Serving benchmark end to end over HTTP (`cartridges serve`, default settings), against the
engine in this process on the same prompts.

1. Concurrency: N streaming clients (each sends its requests one after another), greedy chat
   replies of up to 128 tokens: output tokens/s, time to first token, inter-token latency;
   first on the engine in this process, then through the server. The ratio is what the
   HTTP layer (FastAPI, JSON, server-sent events, the event loop) costs, and on a small machine
   what the clients take of its cores (this process' CPU per step is printed). Beside it, on
   Linux, the server's CPU time outside the engine's compute threads (named "cartridges-step":
   the step and its OpenMP team) per engine step, against the wall time of a step: what the
   HTTP layer and the bridge from the engine to asyncio cost, measured as CPU, which the shared
   cores' noise moves less than wall-clock ratios.
2. Cartridge against document in context over HTTP: U users, each with their own document of
   D tokens and Q questions: (a) the document in the message, (c) a C-token cartridge as
   `model` (its values are the KV of the document's first C tokens: this measures serving,
   not quality; the datablocks are written into the store before the server starts).
3. Chat beside training: one client's time to first token on an idle server, then while a
   training job (self-study synthesis) runs in its worker; the engine gives the worker its
   cores while it runs (`--serve-threads` 0).

    python benchmarks/bench_http.py [--clients 1,16] [--skip-documents] [--skip-training]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import cartridges
from cartridges import Cartridge
from cartridges.models.default import base_model_id
from cartridges.server.keys import bootstrap
from cartridges.store import core, open_store

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import QUESTIONS  # noqa: E402 - the same chat prompts as the other benchmarks
from bench_serving import Timings, percentile  # noqa: E402

API_KEY = "sk-bench-0123456789abcdef"


def messages_for(question: str, document: str | None = None) -> list[dict]:
    content = question if document is None else f"{document}\n\n{question}"
    return [{"role": "user", "content": content}]


# -- the engine in this process ------------------------------------------------------------------


async def engine_clients(model, per_client: list[list[list[int]]], new_tokens: int) -> tuple[Timings, float]:
    timings = Timings()

    async def client(prompts):
        for prompt in prompts:
            start, last = time.perf_counter(), None
            async for delta in model.engine.submit(prompt, max_new_tokens=new_tokens):
                now = time.perf_counter()
                if delta.token is None:
                    continue
                (timings.ttft if last is None else timings.itl).append(now - (start if last is None else last))
                last = now
                timings.tokens += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(p) for p in per_client))
    return timings, time.perf_counter() - start


# -- over HTTP -----------------------------------------------------------------------------------


async def http_chat(http: httpx.AsyncClient, body: dict, timings: Timings) -> None:
    start, last = time.perf_counter(), None
    async with http.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                timings.tokens += chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                now = time.perf_counter()
                (timings.ttft if last is None else timings.itl).append(now - (start if last is None else last))
                last = now


async def http_clients(url: str, bodies_per_client: list[list[dict]]) -> tuple[Timings, float]:
    timings = Timings()
    limits = httpx.Limits(max_connections=len(bodies_per_client) + 4)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600,
                                 limits=limits) as http:
        async def client(bodies):
            for body in bodies:
                await http_chat(http, body, timings)

        start = time.perf_counter()
        await asyncio.gather(*(client(b) for b in bodies_per_client))
        return timings, time.perf_counter() - start


COMPUTE_THREAD = "cartridges-step"  # the engine's compute thread and its OpenMP team (engine.h)


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds so far of process `pid`'s threads: (the engine's compute threads, all others).
    Threads that ended are not counted (the server's threads live as long as it does)."""
    tick = os.sysconf("SC_CLK_TCK")
    compute = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        if name == COMPUTE_THREAD:
            compute += seconds
        else:
            other += seconds
    return compute, other


def engine_steps(url: str) -> int:
    """The server's engine steps so far (its /metrics)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("cartridges_engine_steps_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("no cartridges_engine_steps_total in /metrics")


class Server:
    def __init__(self, data_dir: Path, env: dict[str, str]) -> None:
        self.port = 8700 + random.randrange(200)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(data_dir.parent / "server.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cartridges.cli", "serve", "--port", str(self.port), "--data-dir", str(data_dir),
             "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "CARTRIDGES_API_KEY": API_KEY, **env})
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def write_cartridges(data_dir: Path, model, documents: list[list[int]], tokens: int) -> list[str]:
    """Datablocks whose cartridges are the KV of each document's first tokens, written before
    the server starts (no supervisor to pick them up)."""
    store = open_store(data_dir, sync=False)
    try:
        bootstrap(store, API_KEY)
        user = store.find_user("default")
        owner = core().Owner(user.id, False)
        ids = []
        for i, doc in enumerate(documents):
            blob = store.begin_blob()
            blob.write(model.tokenizer.decode(doc).encode())
            source = store.create_file(owner, blob, f"doc{i}.txt", "cartridge-training")
            record = store.create_datablock(owner, project=f"bench{i}", model=base_model_id(None), model_path="",
                                            training_files=[source.id], config="{}", num_tokens=tokens)
            store.start_datablock(owner, record.run_id, model.fingerprint)
            prefix = model.native.prefix_from_tokens(torch.tensor(doc[:tokens]))
            blob = store.begin_blob()
            blob.write(Cartridge(list(prefix.keys), list(prefix.values), fingerprint=model.fingerprint).to_bytes())
            store.succeed_datablock(owner, record.run_id, blob, json.dumps({"stage": "done", "completed": 0,
                                                                             "total": 0}), "{}")
            ids.append(record.id)
        return ids
    finally:
        store.close()


def random_document(model, tokens: int, rng: random.Random) -> tuple[str, list[int]]:
    """Text of about `tokens` tokens (words of the vocabulary), and its tokens."""
    words = [w for w in (model.tokenizer.decode([i]) for i in range(1000, 9000)) if w.strip().isalpha()]
    text = ""
    while len(model.tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(words).strip() for _ in range(200)) + ". "
    ids = model.tokenizer.encode(text)[:tokens]
    return model.tokenizer.decode(ids), ids


# Longer than 60 lines: the benchmark's steps (server, load, measurements, table) in order.
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--cartridge-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--training-requests", type=int, default=12)
    parser.add_argument("--skip-documents", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]

    model = cartridges.load_model()
    print(f"model {model.name} on cpu, {torch.get_num_threads()} threads; the server with default settings")
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="bench-http-"))
    data_dir = work / "data"
    docs = [random_document(model, args.doc_tokens, rng) for _ in range(args.users)] if not args.skip_documents else []
    cartridge_ids = write_cartridges(data_dir, model, [d[1] for d in docs], args.cartridge_tokens) if docs else []

    # 1. the engine in this process
    engine_tput = {}
    prompts = [model.encode_chat(messages_for(q)) for q in QUESTIONS]
    asyncio.run(engine_clients(model, [[prompts[0]]], 8))  # warm-up
    for n in clients:
        per_client = [[prompts[(c + r) % len(prompts)] for r in range(args.rounds)] for c in range(n)]
        timings, wall = asyncio.run(engine_clients(model, per_client, args.new_tokens))
        engine_tput[n] = timings.tokens / wall
        print(timings.line(f"engine, {n} clients", wall))
    model.engine.close()
    del model
    gc.collect()

    server = Server(data_dir, {})
    try:
        base = httpx.get(server.url + "/v1/status").json()["model"]
        body = {"model": base, "temperature": 0, "max_tokens": args.new_tokens}
        asyncio.run(http_clients(server.url, [[{**body, "messages": messages_for(QUESTIONS[0]), "max_tokens": 8}]]))
        for n in clients:
            per_client = [[{**body, "messages": messages_for(QUESTIONS[(c + r) % len(QUESTIONS)])}
                           for r in range(args.rounds)] for c in range(n)]
            cpu_before, steps_before = thread_cpu_s(server.proc.pid), engine_steps(server.url)
            clients_cpu = time.process_time()
            timings, wall = asyncio.run(http_clients(server.url, per_client))
            clients_cpu = time.process_time() - clients_cpu
            (compute, other), steps = thread_cpu_s(server.proc.pid), engine_steps(server.url) - steps_before
            compute, other = compute - cpu_before[0], other - cpu_before[1]
            tput = timings.tokens / wall
            print(timings.line(f"HTTP, {n} clients", wall) + f"   = {tput / engine_tput[n]:.2f}x the engine")
            if steps and compute > 0:
                step_wall = wall / steps
                print(f"  server CPU per step ({steps} steps, {step_wall * 1e3:.1f} ms of wall each): compute "
                      f"{compute / steps * 1e3:.1f} ms, outside it (HTTP, asyncio, the bridge) "
                      f"{other / steps * 1e3:.2f} ms = {other / steps / step_wall:.1%} of a step; the clients "
                      f"(this process) {clients_cpu / steps * 1e3:.2f} ms")

        if docs:
            answer = {"temperature": 0, "max_tokens": args.answer_tokens}
            asks = [[QUESTIONS[(u + q) % len(QUESTIONS)] for q in range(args.questions)] for u in range(args.users)]
            in_prompt = [[{**answer, "model": base, "messages": messages_for(q, doc[0])} for q in row]
                         for doc, row in zip(docs, asks)]
            timings_a, wall_a = asyncio.run(http_clients(server.url, in_prompt))
            with_cartridge = [[{**answer, "model": cid, "messages": messages_for(q)} for q in row]
                              for cid, row in zip(cartridge_ids, asks)]
            timings_c, wall_c = asyncio.run(http_clients(server.url, with_cartridge))
            print(timings_a.line(f"(a) {args.doc_tokens}-token document in prompt", wall_a))
            print(timings_c.line(f"(c) {args.cartridge_tokens}-token cartridge", wall_c))
            ratio = (timings_c.tokens / wall_c) / (timings_a.tokens / wall_a)
            print(f"{args.users} users x {args.questions} questions over HTTP: throughput (c)/(a) = {ratio:.1f}x, "
                  f"ttft p50 (a)/(c) = {percentile(timings_a.ttft, 50) / percentile(timings_c.ttft, 50):.1f}x")

        if not args.skip_training:
            training_beside(server, base, args.training_requests)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def training_beside(server: Server, base: str, requests: int) -> None:
    chat = [[{"model": base, "temperature": 0, "max_tokens": 32, "messages": messages_for(QUESTIONS[i % 8])}
             for i in range(requests)]]
    idle, _ = asyncio.run(http_clients(server.url, chat))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        text = " ".join(f"Rule {i}: the harbor of Quelmor opens at {i % 12 + 1} o'clock." for i in range(300))
        file_id = http.post("/v1/files", files={"file": ("rules.txt", text.encode())},
                            data={"purpose": "cartridge-training"}).json()["id"]
        block = http.post("/v1/datablocks/train", json={"training_file": file_id,
                                                         "config": {"num_samples": 512}}).json()
        deadline = time.monotonic() + 120
        while http.get(f"/v1/datablocks/{block['id']}").json()["progress"]["stage"] != "synthesizing":
            assert time.monotonic() < deadline, "the training job did not start"
            time.sleep(0.5)
        time.sleep(5)  # the worker has loaded its model and is computing
        threads = http.get("/v1/status").json()["engine"]["threads"]
        busy, _ = asyncio.run(http_clients(server.url, chat))
        still = http.get(f"/v1/datablocks/{block['id']}").json()["status"]
        http.delete(f"/v1/datablocks/{block['id']}")
    p95_idle, p95_busy = percentile(idle.ttft, 95), percentile(busy.ttft, 95)
    print(f"chat beside training (1 client, {requests} requests; engine threads while training: {threads}; "
          f"job still {still} at the end):")
    print(f"  ttft p50 idle {percentile(idle.ttft, 50) * 1e3:7.1f} ms  training {percentile(busy.ttft, 50) * 1e3:7.1f} ms;"
          f"  p95 idle {p95_idle * 1e3:7.1f} ms  training {p95_busy * 1e3:7.1f} ms = {p95_busy / p95_idle:.2f}x;"
          f"  itl p50 idle {percentile(idle.itl, 50) * 1e3:6.1f} ms  training {percentile(busy.itl, 50) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
