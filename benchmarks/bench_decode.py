"""Decode benchmark: our engine against Hugging Face transformers on the default model.

Same prompts, greedy, 128 new tokens (no early stop), batch 1 and batch 8. Prints prefill and
decode tokens/s, the peak memory each run adds to the process, and our/their ratios, and
checks that both produce the same tokens.

    python benchmarks/bench_decode.py [--new-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
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


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (VmHWM), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Run:
    prefill_tok_s: float
    decode_tok_s: float
    peak_mib: float  # peak RSS of the whole process (weights included)
    tokens: list[list[int]]


def run_ours(model: cartridges.Model, prompts: list[list[int]], new_tokens: int) -> Run:
    first_token_at: list[float] = []

    def on_token(i: int, token: int) -> None:
        if not first_token_at:
            first_token_at.append(time.perf_counter())

    start = time.perf_counter()
    results = model.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], on_token=on_token)
    end = time.perf_counter()
    prefill = first_token_at[0] - start
    prompt_tokens = sum(len(p) for p in prompts)
    decoded = len(prompts) * (new_tokens - 1)
    return Run(prompt_tokens / prefill, decoded / (end - first_token_at[0]), peak_rss_mib(),
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
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id,
                             logits_processor=transformers.LogitsProcessorList([clock]))
        end = time.perf_counter()
    prefill = clock.first - start
    prompt_tokens = sum(len(p) for p in prompts)
    decoded = len(prompts) * (new_tokens - 1)
    return Run(prompt_tokens / prefill, decoded / (end - clock.first), peak_rss_mib(),
               out[:, longest:].tolist())


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.decode_tok_s)


def measure(engine: str, batch: int, new_tokens: int, repeats: int, threads: int | None) -> Run:
    """One engine at one batch size, in a fresh process so that its peak memory is its own."""
    if threads:
        torch.set_num_threads(threads)
    ours = cartridges.load_model()  # also the tokenizer for both
    prompts = [ours.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:batch]]
    if engine == "cartridges":
        run = lambda n: run_ours(ours, prompts, n)  # noqa: E731
    else:
        del ours
        path = default_model_path()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        run = lambda n: run_theirs(theirs, prompts, n, pad_id=0)  # noqa: E731
    run(4)  # warm-up
    return best([run(new_tokens) for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the best is reported")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
          f"torch {torch.__version__} ({args.threads or torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}")
    print(f"model: default (SmolLM2-135M-Instruct Q4_1 GGUF), fp32 on cpu; greedy, {args.new_tokens} new tokens; "
          f"best of {args.repeats}; each engine in its own process (peak RSS includes the weights)\n")
    header = f"{'batch':>5} {'engine':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MiB':>9} {'same tokens':>12}"
    print(header)
    print("-" * len(header))
    context = multiprocessing.get_context("spawn")
    for batch in args.batches:
        runs = {}
        for engine in ("cartridges", "transformers"):
            with context.Pool(1) as pool:
                runs[engine] = pool.apply(measure, (engine, batch, args.new_tokens, args.repeats, args.threads))
        mine, ref = runs["cartridges"], runs["transformers"]
        same = sum(a == b for a, b in zip(mine.tokens, ref.tokens))
        for name, r in runs.items():
            print(f"{batch:>5} {name:>12} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} {r.peak_mib:>9.0f} "
                  f"{f'{same}/{batch}' if name == 'cartridges' else '':>12}")
        print(f"{batch:>5} {'ratio':>12} {mine.prefill_tok_s / ref.prefill_tok_s:>13.2f}x "
              f"{mine.decode_tok_s / ref.decode_tok_s:>12.2f}x {mine.peak_mib / ref.peak_mib:>8.2f}x")


if __name__ == "__main__":
    main()
