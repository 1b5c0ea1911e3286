"""Decode speed behind cartridges: greedy tokens a second of the default model in process, with
no prefix, behind one cartridge that every row shares, and behind a cartridge of each row's
own, at batch 1 and 16. A cartridge's keys and values are read at every decode step, so these
rows measure the decode attention over them beside the matrix products.

    python benchmarks/bench_cartridge_decode.py [--new-tokens 128] [--repeats 3]

The cartridges are the KV of random tokens (serving cost only: 1,024 tokens shared, 512 each for
the distinct ones, and a cartridge in 4 parts of 1,024 tokens as `cartridges train --parts`
makes for a 53K-token corpus, its parts composed by mixture, one sequence per part, or routed,
the reply decoded with the heaviest part alone, or searched: the part chosen by BM25 over the
text of the suite's 53K-token chronicle in 4 parts (`PartSearch`, chat's `composition:
"search"`; its time counted) and the reply decoded behind it alone); the prompt is one short chat
turn. Best of
`--repeats` runs per case, with the time to the first token (the prompt read) and the time of
each step after it (the reply decoded) apart.
To compare two builds of the core, run it against each in alternating processes.
"""

from __future__ import annotations

import argparse
import time

from pathlib import Path

import torch

import cartridges
from cartridges.parts import PartSearch, corpus_parts

CORPUS = Path(__file__).resolve().parent / "eval_docs" / "long" / "chronicle.md"
QUESTION = "Describe the water cycle, step by step."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.new_tokens < 1 or args.repeats < 1:
        parser.error("--new-tokens and --repeats must be at least 1")
    model = cartridges.load_model()
    prompt = model.encode_chat([{"role": "user", "content": QUESTION}])
    torch.manual_seed(0)
    vocab = model.native.config.vocab_size
    shared = model.native.prefix_from_tokens(torch.randint(vocab, (1024,)))
    own = [model.native.prefix_from_tokens(torch.randint(vocab, (512,))) for _ in range(16)]
    parts = [model.native.prefix_from_tokens(torch.randint(vocab, (1024,))) for _ in range(4)]
    cases = [
        ("batch 1, no cartridge", 1, None),
        ("batch 16, no cartridge", 16, None),
        ("batch 1, a 1,024-token cartridge", 1, [shared]),
        ("batch 16, one 1,024-token cartridge", 16, [shared]),
        ("batch 16, 16 512-token cartridges", 16, [[p] for p in own]),
        ("batch 1, a cartridge in 4 parts", 1, parts),
        ("batch 16, one cartridge in 4 parts", 16, parts),
        ("batch 1, 4 parts, routed", 1, parts),
        ("batch 16, 4 parts, routed", 16, parts),
        ("batch 1, 4 parts, searched", 1, parts),
        ("batch 16, 4 parts, searched", 16, parts),
    ]
    texts = corpus_parts(model.tokenizer, CORPUS.read_text(), 16_384)  # 4 parts, as `cartridges train` cuts it
    assert len(texts) == len(parts)
    search = PartSearch(model.tokenizer, texts)
    print(f"searched: the question finds part(s) {[j + 1 for j in search.find(QUESTION)]} of the chronicle's 4")
    print(f"default model, {torch.get_num_threads()} threads, {args.new_tokens} greedy tokens, "
          f"best of {args.repeats}")
    for name, batch, prefixes in cases:
        kwargs = {} if prefixes is None else {"prefixes": prefixes}
        if name.endswith("routed"):
            kwargs["composition"] = "route"

        def run(new_tokens: int, prefixes=prefixes, kwargs=kwargs, searched=name.endswith("searched")) -> None:
            if searched:  # as the server does: the part(s) found for the question, every part if none
                kwargs = {"prefixes": [prefixes[j] for j in search.find(QUESTION)] or prefixes}
            model.generate([prompt] * batch, max_new_tokens=new_tokens, stop_token_ids=[], **kwargs)

        run(8)  # warm-up

        def fastest(new_tokens: int) -> float:
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                run(new_tokens)
                best = min(best, time.perf_counter() - start)
            return best

        whole, first = fastest(args.new_tokens), fastest(1)
        later = (whole - first) / max(1, args.new_tokens - 1)
        print(f"{name:<38} {batch * args.new_tokens / whole:7.1f} tok/s   first token {first * 1e3:7.1f} ms   "
              f"a step after it {later * 1e3:5.1f} ms", flush=True)


if __name__ == "__main__":
    main()
