"""Where self-study synthesis spends its time: the teacher's windows (their KV, once per
window), the scoring of written answers behind them, and generation on the engine (A's
questions and B's answers), for a few batches of a document with the defaults that document
gets, then the operators with the largest self time under the PyTorch profiler.

    python benchmarks/profile_synthesis.py [--doc atlas] [--conversations 96] [--device cpu|cuda]
        [--threads N] [--top 15]

A corpus beyond the context writes every conversation from its chunk (recall and yes/no), so
its synthesis is windows and scoring; a short document's is mostly generation. The
conversations are those of the document's first batches under the default seed, in the plan
of a whole run (consecutive batches share a window's KV as they do there).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import cartridges
from cartridges.selfstudy import Corpus, TrainConfig, synthesize
from cartridges.selfstudy.synthesize import Synthesizer

DOCS = Path(__file__).resolve().parent / "eval_docs"
PARTS = {"teacher windows": "_system_kv", "scoring written answers": "_score", "generation": "_generate"}


def document_text(name: str) -> str:
    for path in (DOCS / "long" / f"{name}.md", DOCS / f"{name}.md"):
        if path.exists():
            return path.read_text()
    raise SystemExit(f"no document {name!r} in {DOCS} or {DOCS / 'long'}")


def timed_parts(seconds: collections.Counter, calls: collections.Counter) -> None:
    """Wraps the Synthesizer's methods of PARTS so that each call adds its wall time."""
    for part, name in PARTS.items():
        method = getattr(Synthesizer, name)

        def wrapper(self, *args, _method=method, _part=part, **kwargs):
            start = time.perf_counter()
            try:
                return _method(self, *args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                seconds[_part] += time.perf_counter() - start
                calls[_part] += 1

        setattr(Synthesizer, name, wrapper)


class _Enough(Exception):
    """Stops synthesis once the conversations asked for are made."""


def first_batches(model, corpus, config, conversations: int) -> list:
    """The first batches of the whole run's plan, up to `conversations` conversations: planned
    for all of `config.num_samples`, as a real run plans them (fewer would make chunks grow to
    whole windows, and every batch compute a teacher window of its own)."""
    made: list = []

    def stop_when_enough(so_far: list) -> None:
        if len(so_far) >= conversations:
            made.extend(so_far)
            raise _Enough

    try:
        return synthesize(model, corpus, config, on_batch=stop_when_enough)
    except _Enough:
        return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", default="atlas", help="an evaluation document, short or long (default: atlas)")
    parser.add_argument("--conversations", type=int, default=96, help="conversations to time (default: 96)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads")
    parser.add_argument("--top", type=int, default=15, help="operators to list (default: 15)")
    args = parser.parse_args()
    if args.conversations < 1:
        parser.error("--conversations must be at least 1")
    torch.set_num_threads(args.threads)
    model = cartridges.load_model(device=args.device)
    corpus = Corpus.from_texts(model.tokenizer, [document_text(args.doc)])
    config = TrainConfig().for_corpus(len(corpus))
    print(f"{args.doc}: {len(corpus)} tokens; {config.num_samples} conversations by default, in batches of "
          f"{config.synthesis_batch_size}; chunks of {config.chunk_tokens} tokens, teacher windows of "
          f"{config.teacher_tokens}; written {config.written_fraction}, yes/no {config.verify_fraction}, "
          f"cloze {config.cloze_fraction}")
    first_batches(model, corpus, config, config.synthesis_batch_size)  # warm-up
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    timed_parts(seconds, calls)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    # The engine computes on its own thread: profile every thread, not only this one.
    experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=experimental) as prof:
        start = time.perf_counter()
        conversations = first_batches(model, corpus, config, args.conversations)
        wall = time.perf_counter() - start
    kinds = collections.Counter(c.kind for c in conversations)
    print(f"\n{len(conversations)} conversations in {wall:.1f} s ({len(conversations) / wall:.2f} a second); "
          f"kinds: {dict(kinds)}")
    print(f"| part | calls | s | share |\n|---|---|---|---|")
    for part in PARTS:
        print(f"| {part} | {calls[part]} | {seconds[part]:.2f} | {seconds[part] / wall:.0%} |")
    rest = wall - sum(seconds.values())
    print(f"| the rest (text, tokenizer, batching) | | {rest:.2f} | {rest / wall:.0%} |")
    sort_by = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
