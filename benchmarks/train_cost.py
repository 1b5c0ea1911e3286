"""What training a cartridge costs, and how it grows with the corpus and the cartridge.

Each run trains on one evaluation document with a short plan (--num-samples conversations,
one epoch, no quality report) in a fresh process, and reports what a full run is made of:
seconds per synthesized conversation, seconds per optimizer step, and the process's peak
resident memory (VmHWM: model, engine, synthesis and training together). A full default run
costs about num_samples x s/conversation + epochs x num_samples / batch_size x s/step.
The first run is the baseline: the short handbook (2.5K tokens) at its default cartridge
length; every other row gives its step time and peak as ratios to it.

    python benchmarks/train_cost.py                                  # handbook, then atlas at 512..2048
    python benchmarks/train_cost.py --runs handbook:default atlas:default chronicle:default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent / "eval_docs"
DEFAULT_RUNS = ("handbook:default", "atlas:512", "atlas:1024", "atlas:2048", "atlas:default")


def document(name: str) -> str:
    path = DOCS / f"{name}.md"
    return (path if path.exists() else DOCS / "long" / f"{name}.md").read_text()


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_run(name: str, size: str, num_samples: int, threads: int) -> dict:
    """Trains in this process and returns its figures (run in a child: the peak is its own)."""
    import torch

    import cartridges
    from cartridges.selfstudy import Corpus, TrainConfig

    if threads:
        torch.set_num_threads(threads)
    model = cartridges.load_model()
    text = document(name)
    corpus_tokens = len(Corpus.from_texts(model.tokenizer, [text]))
    config = TrainConfig(num_tokens=None if size == "default" else int(size), num_samples=num_samples, epochs=1,
                         quality_samples=0)
    started = time.perf_counter()
    cartridge = cartridges.train(model, [text], config, progress=False)
    stats = cartridge.stats
    return {"document": name, "corpus_tokens": corpus_tokens, "num_tokens": cartridge.num_tokens,
            "conversations": stats["num_conversations"], "steps": stats["steps"],
            "s_per_conversation": stats["synthesis_s"] / max(stats["num_conversations"], 1),
            "s_per_step": stats["training_s"] / max(stats["steps"], 1),
            "wall_s": time.perf_counter() - started, "peak_rss_mib": peak_rss_mib()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), metavar="DOC:TOKENS",
                        help="document and cartridge length (`default`: decided from the corpus); the first is the "
                             "baseline")
    parser.add_argument("--num-samples", type=int, default=64, help="conversations per run (default 64)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # DOC:TOKENS, in a child process
    args = parser.parse_args()
    if args.one:
        name, size = args.one.split(":")
        print(json.dumps(one_run(name, size, args.num_samples, args.threads)))
        return 0
    rows = []
    for run in args.runs:
        done = subprocess.run([sys.executable, __file__, "--one", run, "--num-samples", str(args.num_samples),
                               "--threads", str(args.threads)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row, base = rows[-1], rows[0]
        print(f"{row['document']:>10} {row['corpus_tokens']:>7,} tokens  cartridge {row['num_tokens']:>5}  "
              f"{row['s_per_conversation']:5.2f} s/conversation  {row['s_per_step']:5.2f} s/step "
              f"({row['s_per_step'] / base['s_per_step']:4.1f}x)  peak {row['peak_rss_mib']:7,.0f} MiB "
              f"({row['peak_rss_mib'] / base['peak_rss_mib']:4.1f}x)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"num_samples": args.num_samples, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
