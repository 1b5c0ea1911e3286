"""Serving benchmark of the engine (in process, default engine options).

1. Concurrency: 1, 4, 16, 32 clients streaming chat replies of 128 tokens (each client sends
   its requests one after another): output tokens/s, time to first token and inter-token
   latency p50/p95, against one offline batch of 16 in the same run.
2. Cartridge against document in context: U users, each with their own document of D tokens
   and Q questions, asked one after another per user, all users at once:
   (a) the document in every prompt, (b) the document's KV computed once per user and reused
   as a prefix, (c) a C-token cartridge per user (its values are the KV of the document's first
   C tokens: this measures serving, not quality). Tokens/s, time to first token, KV bytes/user.
3. Composition: the same U users, each with two C-token cartridges of their own, ask their Q
   questions with one cartridge, then with both composed by mixture (the default: a sequence
   per cartridge) and by concatenation (one sequence behind both).

    python benchmarks/bench_serving.py [--device cpu|cuda] [--random-weights] [--skip-documents]
                                       [--skip-composition] [--no-cuda-graphs]

`--random-weights` builds the default model's shape with random weights (for a machine
without the embedded model; speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import time
from dataclasses import dataclass, field

import torch

import cartridges
from cartridges import Model
from cartridges.models import ModelConfig

from bench_decode import QUESTIONS  # the same chat prompts as the decode benchmark


def random_smollm2(device: str) -> Model:
    config = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, eos_token_ids=[2])
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) * (0.02 if len(shape) == 2 else 0.0) + (1.0 if len(shape) == 1 else 0.0)
               for name, shape in config.expected_tensors().items()}
    return Model(config, tensors, None, name="random-smollm2", device=device)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@dataclass
class Timings:
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def line(self, label: str, wall: float) -> str:
        return (f"{label:<28} {self.tokens / wall:8.1f} tok/s   ttft p50 {percentile(self.ttft, 50) * 1e3:7.1f} ms "
                f"p95 {percentile(self.ttft, 95) * 1e3:7.1f} ms   itl p50 {percentile(self.itl, 50) * 1e3:6.1f} ms "
                f"p95 {percentile(self.itl, 95) * 1e3:6.1f} ms")


async def timed_request(engine, prompt, timings: Timings, **kwargs) -> None:
    start = time.perf_counter()
    last = None
    async for delta in engine.submit(prompt, **kwargs):
        now = time.perf_counter()
        if delta.token is None:
            continue
        if last is None:
            timings.ttft.append(now - start)
        else:
            timings.itl.append(now - last)
        last = now
        timings.tokens += 1


async def clients_run(engine, prompts_per_client: list[list[list[int]]], timings: Timings,
                      prefixes_per_client: list[list] | None = None, **kwargs) -> float:
    async def client(prompts, prefixes):
        for prompt in prompts:
            await timed_request(engine, prompt, timings, prefixes=prefixes, **kwargs)

    start = time.perf_counter()
    prefixes_per_client = prefixes_per_client or [[]] * len(prompts_per_client)
    await asyncio.gather(*(client(p, c) for p, c in zip(prompts_per_client, prefixes_per_client)))
    return time.perf_counter() - start


def chat_prompt(model: Model, text: str) -> list[int]:
    if model.tokenizer is not None:
        return model.encode_chat([{"role": "user", "content": text}])
    return [1 + (ord(c) % 1000) for c in text]  # random weights: any ids will do


def concurrency(model: Model, clients: list[int], new_tokens: int, rounds: int) -> None:
    engine = model.engine
    kwargs = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    prompts = [chat_prompt(model, q) for q in QUESTIONS]
    # Warm-up, then the offline baseline: one batch of 16 submitted at once.
    engine.submit_many(prompts[:2], max_new_tokens=8, stop_token_ids=[])[1].result()
    start = time.perf_counter()
    streams = engine.submit_many([prompts[i % len(prompts)] for i in range(16)], **kwargs)
    produced = sum(len(s.result().tokens) for s in streams)
    offline = produced / (time.perf_counter() - start)
    print(f"{'offline batch of 16':<28} {offline:8.1f} tok/s")
    for n in clients:
        timings = Timings()
        per_client = [[prompts[(c + r) % len(prompts)] for r in range(rounds)] for c in range(n)]
        wall = asyncio.run(clients_run(engine, per_client, timings, **kwargs))
        line = timings.line(f"{n} streaming clients", wall)
        if n == 16:
            line += f"   = {timings.tokens / wall / offline:.2f}x offline batch of 16"
        print(line)


def documents(model: Model, users: int, doc_tokens: int, questions: int, cartridge_tokens: int, new_tokens: int) -> None:
    engine = model.engine
    rng = random.Random(0)
    vocab = model.config.vocab_size
    docs = [[rng.randrange(3, vocab) for _ in range(doc_tokens)] for _ in range(users)]
    asks = [[chat_prompt(model, QUESTIONS[(u + q) % len(QUESTIONS)]) for q in range(questions)] for u in range(users)]
    kwargs = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (2 if model.dtype == "bfloat16" else 4)
    question_len = max(len(a) for row in asks for a in row)
    results = {}
    labels = {"a": "(a) document in prompt", "b": "(b) document KV reused", "c": f"(c) {cartridge_tokens}-token cartridge"}

    def report(key: str) -> None:  # as each part ends: (a) alone takes half an hour at 16 x 4000 on 2 cores
        timings, wall, kv = results[key]
        print(timings.line(labels[key], wall) + f"   KV/user {kv / 2**20:6.1f} MiB", flush=True)

    # (a) the document in every prompt
    timings = Timings()
    wall = asyncio.run(clients_run(engine, [[d + a for a in row] for d, row in zip(docs, asks)], timings, **kwargs))
    results["a"] = (timings, wall, (doc_tokens + question_len + new_tokens) * per_token)
    report("a")

    # (b) the document's KV once per user (computed inside the timed run), reused as a prefix
    async def with_prefix(make_prefix):
        timings = Timings()

        async def user(doc, row):
            prefix = await asyncio.to_thread(make_prefix, doc)
            for a in row:
                await timed_request(engine, a, timings, prefixes=[prefix], **kwargs)

        start = time.perf_counter()
        await asyncio.gather(*(user(d, row) for d, row in zip(docs, asks)))
        return timings, time.perf_counter() - start

    document_kv = lambda doc: model.native.prefix_from_tokens(torch.tensor(doc))  # noqa: E731
    timings, wall = asyncio.run(with_prefix(document_kv))
    results["b"] = (timings, wall, (doc_tokens + question_len + new_tokens) * per_token)
    report("b")

    # (c) a cartridge per user, made before the run (training is not serving)
    carts = {id(d): model.native.prefix_from_tokens(torch.tensor(d[:cartridge_tokens])) for d in docs}
    timings, wall = asyncio.run(with_prefix(lambda doc: carts[id(doc)]))
    results["c"] = (timings, wall, (cartridge_tokens + question_len + new_tokens) * per_token)
    report("c")
    tput = {k: t.tokens / w for k, (t, w, _) in results.items()}
    print(f"throughput (c)/(a) = {tput['c'] / tput['a']:.1f}x   (c)/(b) = {tput['c'] / tput['b']:.1f}x")


def composition(model: Model, users: int, questions: int, cartridge_tokens: int, new_tokens: int) -> None:
    rng = random.Random(1)
    vocab = model.config.vocab_size

    def cartridge():  # serving cost only: the KV of random tokens
        return model.native.prefix_from_tokens(torch.tensor([rng.randrange(3, vocab) for _ in range(cartridge_tokens)]))

    carts = [[cartridge(), cartridge()] for _ in range(users)]
    asks = [[chat_prompt(model, QUESTIONS[(u + q) % len(QUESTIONS)]) for q in range(questions)] for u in range(users)]
    kwargs = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    runs = {"one cartridge": ([c[:1] for c in carts], "mixture"),
            "two, mixture (default)": (carts, "mixture"),
            "two, concatenated": (carts, "concatenate")}
    tput = {}
    for label, (prefixes, how) in runs.items():
        timings = Timings()
        wall = asyncio.run(clients_run(model.engine, asks, timings, prefixes, composition=how, **kwargs))
        tput[label] = timings.tokens / wall
        print(timings.line(label, wall), flush=True)
    print(f"two cartridges by mixture: {tput['two, mixture (default)'] / tput['one cartridge']:.2f}x one cartridge's "
          f"throughput, {tput['two, mixture (default)'] / tput['two, concatenated']:.2f}x concatenation's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--clients", default="1,4,16,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--cartridge-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument("--skip-documents", action="store_true")
    parser.add_argument("--skip-composition", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="decode steps on CUDA without CUDA graphs (the packed step), as a baseline")
    args = parser.parse_args()

    model = random_smollm2(args.device) if args.random_weights else cartridges.load_model(device=args.device)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"model {model.name} ({model.dtype}) on {args.device}: {where}, {torch.get_num_threads()} threads")
    if args.no_cuda_graphs:
        model.start_engine(cuda_graphs=False)
    options = model.engine.options
    print(f"engine: kv_tokens={options.kv_tokens} max_running={options.max_running} "
          f"prefill_tokens_per_step={options.prefill_tokens_per_step} cuda_graphs={options.cuda_graphs}")
    if not args.skip_concurrency:
        concurrency(model, [int(n) for n in args.clients.split(",")], args.new_tokens, args.rounds)
    if not args.skip_documents:
        documents(model, args.users, args.doc_tokens, args.questions, args.cartridge_tokens, args.answer_tokens)
    if not args.skip_composition:
        composition(model, args.users, args.questions, args.cartridge_tokens, args.answer_tokens)
    stats = model.engine.stats()
    print(f"engine steps {stats.steps}: {stats.fixed_shape_steps} fixed-shape decode steps, "
          f"{stats.cuda_graph_captures} CUDA graphs captured")


if __name__ == "__main__":
    main()
