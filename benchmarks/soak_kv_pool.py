"""The KV pool under churn: requests of mixed lengths, some behind cartridges of mixed sizes,
for a while, against the engine in this process.

    .venv/bin/python benchmarks/soak_kv_pool.py [--minutes 30] [--kv-tokens 16384] [--in-flight 12]

Each of `in-flight` clients submits one request after another: a prompt of 8 to 4,000 tokens
(log-uniform), up to 8-128 new tokens, and every third request behind one of four cartridges
of 64 to 2,048 tokens. Every second it samples the engine's pool (used and total KV tokens,
running and waiting requests) and the process' resident memory. Reported:

- requests served and refused (ContextLengthError: the request could never fit; busy);
- *stalls*: samples in which requests waited while the pool's free total was at least the
  largest reserve (prompt + max tokens) among the requests then without a first token, in
  this sample and the one before, with at least two engine steps between them (so that the
  engine had a step's planning to admit them: a request queued during a long step is not a
  stall): waits that a pool without fragmentation would not have made (the engine packs the
  running requests' ranges when the free slots suffice and no free range does: `compactions`);
- time from submission to the first token (p50, p95, max);
- resident memory at the first sample, its largest and at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import threading
import time
from pathlib import Path

import torch

import cartridges
from cartridges import ContextLengthError, EngineBusyError

RESULTS = Path(__file__).resolve().parent / "results" / "soak_kv_pool.json"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--in-flight", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = cartridges.load_model()
    engine = model.start_engine(kv_tokens=args.kv_tokens)
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    cartridges_kv = [model.native.prefix_from_tokens(torch.randint(vocab, (n,))) for n in (64, 256, 1024, 2048)]
    deadline = time.monotonic() + args.minutes * 60
    lock = threading.Lock()
    waiting: dict[int, int] = {}  # client -> reserve of its request still without a first token
    first_token_s: list[float] = []
    counts = {"served": 0, "context_length": 0, "busy": 0}

    def client(index: int) -> None:
        local = random.Random(rng.random())
        while time.monotonic() < deadline:
            prompt_tokens = int(math.exp(local.uniform(math.log(8), math.log(4000))))
            new_tokens = local.randint(8, 128)
            prefix = [local.choice(cartridges_kv)] if local.random() < 1 / 3 else []
            prompt = torch.randint(vocab, (prompt_tokens,)).tolist()
            started = time.monotonic()
            with lock:
                waiting[index] = prompt_tokens + new_tokens
            try:
                stream = engine.submit(prompt, prefixes=prefix, max_new_tokens=new_tokens, stop_token_ids=[])
                first = True
                for _ in stream:
                    if first:
                        with lock:
                            waiting.pop(index, None)
                            first_token_s.append(time.monotonic() - started)
                        first = False
                with lock:
                    counts["served"] += 1
            except ContextLengthError:
                with lock:
                    counts["context_length"] += 1
            except EngineBusyError:
                with lock:
                    counts["busy"] += 1
                time.sleep(0.5)
            finally:
                with lock:
                    waiting.pop(index, None)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.in_flight)]
    for thread in threads:
        thread.start()
    samples, stalls, memory, stalled_before, steps_before = 0, 0, [], False, 0
    while any(thread.is_alive() for thread in threads):
        time.sleep(1.0)
        stats = engine.stats()
        with lock:
            largest_waiting = max(waiting.values(), default=0)
        free = stats.kv_tokens_total - stats.kv_tokens_used
        samples += 1
        stalled = stats.waiting > 0 and free >= largest_waiting > 0
        # Two samples in a row, and the engine planned a step in between: not a request queued
        # between two steps, nor one waiting for a long step to end.
        if stalled and not stalled_before:
            steps_before = stats.steps
        stalls += int(stalled and stalled_before and stats.steps - steps_before >= 2)
        stalled_before = stalled
        memory.append(rss_mib())
    for thread in threads:
        thread.join()

    ttft = sorted(first_token_s)
    report = {
        "minutes": args.minutes, "kv_tokens": args.kv_tokens, "in_flight": args.in_flight, **counts,
        "samples": samples, "stalls": stalls, "compactions": engine.stats().kv_compactions,
        "first_token_s": {"p50": statistics.median(ttft) if ttft else None,
                          "p95": ttft[int(0.95 * (len(ttft) - 1))] if ttft else None, "max": ttft[-1] if ttft else None},
        "rss_mib": {"first": memory[0] if memory else None, "max": max(memory, default=None),
                    "last": memory[-1] if memory else None},
    }
    print(f"{args.minutes:g} min, pool {args.kv_tokens} tokens, {args.in_flight} clients: "
          f"{counts['served']} served, {counts['context_length']} ContextLengthError, {counts['busy']} busy")
    print(f"stalls (waiting while the free total fit every waiting request): {stalls} of {samples} samples; "
          f"{report['compactions']} compactions of the pool")
    if ttft:
        print(f"submission to first token: p50 {report['first_token_s']['p50']:.2f} s, "
              f"p95 {report['first_token_s']['p95']:.2f} s, max {ttft[-1]:.2f} s")
    if memory:
        print(f"resident memory: {memory[0]:.0f} MiB at the first sample, {max(memory):.0f} MiB at most, "
              f"{memory[-1]:.0f} MiB at the end")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    engine.close()


if __name__ == "__main__":
    main()
