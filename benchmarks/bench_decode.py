"""Decode benchmark: our engine against Hugging Face transformers on the default model.

Same prompts, greedy, 128 new tokens (no early stop), batch 1 and batch 8. Prints prefill and
decode tokens/s, the peak memory each run adds to the process, and our/their ratios, and
checks that both produce the same tokens.

    python benchmarks/bench_decode.py [--new-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import platform
import threading
import time
from dataclasses import dataclass

import psutil
import torch
import transformers

import cartridges
from cartridges.models import default_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Explain in a few sentences how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "List three tips for staying focused while studying.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Describe the water cycle, step by step, and why it matters for farming and cities.",
    "Give me a recipe idea for dinner with rice and vegetables.",
    "What are the main differences between a cat and a dog as pets, in terms of care and temperament?",
]


class PeakRss:
    """Peak resident memory above the level at start, sampled every millisecond."""

    def __init__(self) -> None:
        self.process = psutil.Process()

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()

    @property
    def added_mib(self) -> float:
        return (self.peak - self.base) / 2**20


@dataclass
class Run:
    prefill_tok_s: float
    decode_tok_s: float
    peak_mib: float
    tokens: list[list[int]]


def run_ours(model: cartridges.Model, prompts: list[list[int]], new_tokens: int) -> Run:
    first_token_at: list[float] = []

    def on_token(i: int, token: int) -> None:
        if not first_token_at:
            first_token_at.append(time.perf_counter())

    with PeakRss() as memory:
        start = time.perf_counter()
        results = model.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], on_token=on_token)
        end = time.perf_counter()
    prefill = first_token_at[0] - start
    prompt_tokens = sum(len(p) for p in prompts)
    decoded = len(prompts) * (new_tokens - 1)
    return Run(prompt_tokens / prefill, decoded / (end - first_token_at[0]), memory.added_mib,
               [r.tokens for r in results])


class StepClock(transformers.LogitsProcessor):
    """Records when transformers asks for the first token's logits processing: end of prefill."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def run_theirs(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Run:
    longest = max(len(p) for p in prompts)
    # Left padding, as transformers expects for batched generation.
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with PeakRss() as memory, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id,
                             logits_processor=transformers.LogitsProcessorList([clock]))
        end = time.perf_counter()
    prefill = clock.first - start
    prompt_tokens = sum(len(p) for p in prompts)
    decoded = len(prompts) * (new_tokens - 1)
    return Run(prompt_tokens / prefill, decoded / (end - clock.first), memory.added_mib,
               out[:, longest:].tolist())


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.decode_tok_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the best is reported")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ours = cartridges.load_model()
    path = default_model_path()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    prompts = [ours.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}")
    print(f"model: {ours.name}, fp32 on cpu; greedy, {args.new_tokens} new tokens; best of {args.repeats}\n")

    header = f"{'batch':>5} {'engine':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MiB':>9} {'same tokens':>12}"
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        chosen = prompts[:batch]
        run_ours(ours, chosen, 4)  # warm-up
        mine = best([run_ours(ours, chosen, args.new_tokens) for _ in range(args.repeats)])
        run_theirs(theirs, chosen, 4, pad_id=0)
        ref = best([run_theirs(theirs, chosen, args.new_tokens, pad_id=0) for _ in range(args.repeats)])
        same = sum(a == b for a, b in zip(mine.tokens, ref.tokens))
        for name, r in (("cartridges", mine), ("transformers", ref)):
            print(f"{batch:>5} {name:>12} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} {r.peak_mib:>9.1f} "
                  f"{f'{same}/{batch}' if name == 'cartridges' else '':>12}")
        print(f"{batch:>5} {'ratio':>12} {mine.prefill_tok_s / ref.prefill_tok_s:>13.2f}x "
              f"{mine.decode_tok_s / ref.decode_tok_s:>12.2f}x {mine.peak_mib / max(ref.peak_mib, 1e-9):>8.2f}x")


if __name__ == "__main__":
    main()
