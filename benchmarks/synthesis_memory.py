"""Does synthesis grow the process batch after batch? Resident memory after each synthesis
batch on a long document, with the heap's free memory handed back after each batch (what
synthesis does) and without (the baseline), each in a fresh process.

    python benchmarks/synthesis_memory.py                      # atlas, 160 conversations
    python benchmarks/synthesis_memory.py --doc chronicle --num-samples 320
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent / "eval_docs"


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return -1


def one_run(doc: str, num_samples: int, release: bool) -> list[int]:
    """Resident MiB after each batch of a synthesis of `num_samples` conversations."""
    import cartridges
    import cartridges.selfstudy.synthesize as synthesis
    from cartridges.selfstudy import Corpus, TrainConfig

    if not release:
        synthesis.release_free_memory = lambda: None
    model = cartridges.load_model()
    path = DOCS / f"{doc}.md"
    text = (path if path.exists() else DOCS / "long" / f"{doc}.md").read_text()
    corpus = Corpus.from_texts(model.tokenizer, [text])
    after_batch: list[int] = []
    synthesis.synthesize(model, corpus, TrainConfig(num_samples=num_samples, quality_samples=0),
                         on_batch=lambda conversations: after_batch.append(rss_mib()))
    return after_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", default="atlas", help="an evaluation document (default: atlas)")
    parser.add_argument("--num-samples", type=int, default=160, help="conversations (default 160: 10 batches)")
    parser.add_argument("--one", choices=("release", "keep"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.doc, args.num_samples, args.one == "release")))
        return 0
    for mode in ("keep", "release"):
        done = subprocess.run([sys.executable, __file__, "--one", mode, "--doc", args.doc,
                               "--num-samples", str(args.num_samples)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        after = json.loads(done.stdout.strip().splitlines()[-1])
        label = "free memory kept (baseline)" if mode == "keep" else "free memory released"
        print(f"{label:>28}: MiB after each batch {after}; last minus first {after[-1] - after[0]:+,} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
