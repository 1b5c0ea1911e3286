"""Do greedy outputs at batch 16 differ from transformers because of near-ties or a bug?

Generates greedily for 16 chat prompts with the engine and with transformers (batch 16, left
padding) on the default model. For every sequence that differs, takes the first position
where the tokens part and reports transformers' own margin there (its top logit minus the
logit of the token the engine chose, both computed by transformers on the common prefix,
unpadded). A near-tie is a margin of the order of float32 summation noise (< 1e-3 of the logit
scale); a bug would show as a clear margin.

    python benchmarks/check_batch16_divergence.py [--new-tokens 128]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import cartridges
from cartridges.models import default_model_path

from bench_decode import QUESTIONS  # the same prompts as the decode benchmark

EXTRA = [
    "Name three rivers in Africa.",
    "How do bees make honey?",
    "Summarize the plot of a detective story in two sentences.",
    "What should I pack for a weekend hike?",
    "Explain what a prime number is.",
    "Suggest a name for a small bakery.",
    "Why do leaves change color in autumn?",
    "Write a haiku about the sea.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    ours = cartridges.load_model()
    prompts = [ours.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS + EXTRA]
    got = ours.generate(prompts, max_new_tokens=args.new_tokens, stop_token_ids=[])

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding, as transformers expects
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[:, width:].tolist()

    same = 0
    for i, (prompt, mine) in enumerate(zip(prompts, got)):
        if mine.tokens == theirs[i]:
            same += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(mine.tokens, theirs[i])) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + theirs[i][:k]])).logits[0, -1]
        margin = (logits[theirs[i][k]] - logits[mine.tokens[k]]).item()
        print(f"sequence {i:2d}: first differs at token {k:3d}: transformers' margin for its choice "
              f"{margin:.2e} (logit scale {logits.abs().max().item():.1f})")
    print(f"{same}/{len(prompts)} sequences identical")


if __name__ == "__main__":
    main()
