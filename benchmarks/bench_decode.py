"""Decode benchmark: our engine against Hugging Face transformers on the default model.

Same prompts, greedy, 128 new tokens (no early stop), batch 1 and batch 8 (batches past 8 repeat
the 8 questions). Prints prefill and decode tokens/s, the peak memory each run adds to the
process, and our/their ratios. Our engine runs twice: with its default int8 activations, and
with float32 activations ("ours fp32-act", transformers' arithmetic), whose tokens should
equal transformers'.

    python benchmarks/bench_decode.py [--new-tokens 128] [--repeats 2] [--threads N] [--llama-cpp]

`--llama-cpp` also runs llama.cpp (llama-cpp-python) on the same GGUF file with the same
chat-templated token ids, on the same number of threads. Its high-level `Llama` decodes one
sequence at a time, so this uses the low-level API: N sequences decode together, one
`llama_decode` per step, as llama.cpp's batched example does. llama-cpp-python is a
benchmark-only dependency (never installed by `make test` or CI); build it from source for
this machine's CPU, from the repository root (the build uses scikit-build-core, cmake and ninja
from .venv; `--no-deps` keeps pip off torch; multimodal support, LLAVA_BUILD, is not needed):

    mkdir -p ../llama-build    # outside the repository
    .venv/bin/python -m pip download llama-cpp-python --no-binary :all: --no-deps --no-build-isolation \\
        -d ../llama-build
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
        -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=1 \\
        .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w ../llama-build \\
        ../llama-build/llama_cpp_python-*.tar.gz
    .venv/bin/python -m pip install --no-deps diskcache ../llama-build/llama_cpp_python-*.whl
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch
import transformers

import cartridges
from cartridges.models import default_model_path

# Our engine with float32 activations on the quantized weights (int8_activations=False):
# transformers' arithmetic, so its tokens should equal transformers'.
EXACT = "ours fp32-act"

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


def questions(batch: int) -> list[str]:
    """`batch` chat questions: the list above, repeated for batches past its length."""
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]


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


def llama_cpp_version() -> str:
    """llama-cpp-python's version; without it, exit with how to build it."""
    try:
        import llama_cpp
    except (ImportError, OSError) as e:  # OSError: the package is there but its library does not load
        build = __doc__[__doc__.index("    mkdir"):].rstrip()
        sys.exit(f"--llama-cpp needs llama-cpp-python ({e}). It is a benchmark-only dependency; "
                 f"build it from source, from the repository root:\n\n{build}")
    return llama_cpp.__version__


@dataclass
class LlamaCpp:
    """llama.cpp's model and a context sized for one batch of prompts (low-level API)."""

    lib: object  # the llama_cpp module: imported only in the process that measures it
    ctx: object
    vocab_size: int
    keep: tuple  # the model and the log callback: ctx uses them, so they must outlive it


def load_llama_cpp(prompts: list[list[int]], new_tokens: int, threads: int) -> LlamaCpp:
    import llama_cpp as lib

    quiet = lib.llama_log_callback(lambda level, text, user_data: None)  # its load log would bury the table
    lib.llama_log_set(quiet, None)
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(default_model_path()).encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    # Room for every sequence, whether llama.cpp splits the KV cache per sequence or not.
    params.n_ctx = len(prompts) * (max(len(p) for p in prompts) + new_tokens)
    params.n_batch = max(params.n_batch, sum(len(p) for p in prompts))  # the whole prefill in one llama_decode
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params) if model else None
    if not ctx:  # its log, which would say why, is silenced
        raise RuntimeError(f"llama.cpp could not load {default_model_path()}")
    return LlamaCpp(lib, ctx, lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)), (model, quiet))


def fill_batch(batch, rows: list[tuple[int, int, int, bool]]) -> None:
    """Writes (sequence, position, token, wants logits) rows into a llama_batch."""
    for k, (seq, pos, token, logits) in enumerate(rows):
        batch.token[k], batch.pos[k], batch.logits[k] = token, pos, logits
        batch.n_seq_id[k] = 1
        batch.seq_id[k][0] = seq
    batch.n_tokens = len(rows)


def decode_greedy(llama: LlamaCpp, batch, rows: list[int]) -> list[int]:
    """One llama_decode of the batch, then the argmax of the logits of each row in `rows`."""
    if llama.lib.llama_decode(llama.ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    logits = (llama.lib.llama_get_logits_ith(llama.ctx, row) for row in rows)
    return [int(np.ctypeslib.as_array(ptr, shape=(llama.vocab_size,)).argmax()) for ptr in logits]


def run_llama_cpp(llama: LlamaCpp, prompts: list[list[int]], new_tokens: int) -> Run:
    lib = llama.lib
    lib.llama_memory_clear(lib.llama_get_memory(llama.ctx), True)  # each run starts from an empty cache
    batch = lib.llama_batch_init(max(sum(len(p) for p in prompts), len(prompts)), 0, 1)
    try:
        start = time.perf_counter()
        # Prefill: every prompt in one batch; logits at each prompt's last token only.
        rows = [(i, pos, t, pos == len(p) - 1) for i, p in enumerate(prompts) for pos, t in enumerate(p)]
        fill_batch(batch, rows)
        tokens = [[t] for t in decode_greedy(llama, batch, [k for k, row in enumerate(rows) if row[3]])]
        first = time.perf_counter()
        # Decode: each sequence's last token at its next position, all sequences in one llama_decode.
        for step in range(1, new_tokens):
            fill_batch(batch, [(i, len(p) + step - 1, out[-1], True)
                               for i, (p, out) in enumerate(zip(prompts, tokens))])
            for out, t in zip(tokens, decode_greedy(llama, batch, list(range(len(prompts))))):
                out.append(t)
        end = time.perf_counter()
    finally:
        lib.llama_batch_free(batch)
    prompt_tokens = sum(len(p) for p in prompts)
    decoded = len(prompts) * (new_tokens - 1)
    return Run(prompt_tokens / (first - start), decoded / (end - first), peak_rss_mib(), tokens)


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.decode_tok_s)


def warm_then_best(run, new_tokens: int, repeats: int) -> Run:
    run(4)  # warm-up
    return best([run(new_tokens) for _ in range(repeats)])


def measure(engine: str, batch: int, new_tokens: int, repeats: int, threads: int | None) -> Run:
    """One engine at one batch size, in a fresh process so that its peak memory is its own."""
    if threads:
        torch.set_num_threads(threads)
    # also the tokenizer for both; "exact": float32 activations on the quantized weights
    ours = cartridges.load_model(int8_activations=engine != EXACT)
    prompts = [ours.encode_chat([{"role": "user", "content": q}]) for q in questions(batch)]
    if engine in ("cartridges", EXACT):
        # Every prompt is prefilled whole, as the other engines do: the cache of shared chat
        # openings (which a server keeps on) would skip the system prompt after the first run.
        ours.start_engine(cache_openings=False)
        run = lambda n: run_ours(ours, prompts, n)  # noqa: E731
    else:
        del ours
        path = default_model_path()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        run = lambda n: run_theirs(theirs, prompts, n, pad_id=0)  # noqa: E731
    return warm_then_best(run, new_tokens, repeats)


def chat_prompts(batches: list[int]) -> list[list[int]]:
    """The token ids our engine gets (our chat template), for llama.cpp; made in a process of
    their own so that llama.cpp's peak memory holds none of our weights."""
    ours = cartridges.load_model()
    return [ours.encode_chat([{"role": "user", "content": q}]) for q in questions(max(batches))]


def measure_llama_cpp(prompts: list[list[int]], new_tokens: int, repeats: int, threads: int) -> Run:
    """llama.cpp at one batch size (len(prompts)), in a fresh process like the others."""
    llama = load_llama_cpp(prompts, new_tokens, threads)
    return warm_then_best(lambda n: run_llama_cpp(llama, prompts, n), new_tokens, repeats)


def in_fresh_process(context, fn, *args):
    with context.Pool(1) as pool:
        return pool.apply(fn, args)


def same_tokens(mine: Run, ref: Run) -> str:
    return f"{sum(a == b for a, b in zip(mine.tokens, ref.tokens))}/{len(mine.tokens)}"


def print_ratio(batch: int, label: str, mine: Run, ref: Run) -> None:
    print(f"{batch:>5} {label:>13} {mine.prefill_tok_s / ref.prefill_tok_s:>13.2f}x "
          f"{mine.decode_tok_s / ref.decode_tok_s:>12.2f}x {mine.peak_mib / ref.peak_mib:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the best is reported")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, and llama.cpp's threads (default: torch's)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp (llama-cpp-python, built from source: see above)")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    llama_version = llama_cpp_version() if args.llama_cpp else None  # before any run: exits if missing

    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
          f"torch {torch.__version__} ({threads} threads), transformers {transformers.__version__}"
          + (f", llama-cpp-python {llama_version} ({threads} threads)" if llama_version else ""))
    print(f"model: default (SmolLM2-135M-Instruct Q4_1 GGUF), fp32 on cpu; greedy, {args.new_tokens} new tokens; "
          f"best of {args.repeats}; each engine in its own process (peak RSS includes the weights)\n")
    header = f"{'batch':>5} {'engine':>13} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak MiB':>9} {'same tokens':>12}"
    print(header)
    print("-" * len(header))
    context = multiprocessing.get_context("spawn")
    prompts = in_fresh_process(context, chat_prompts, args.batches) if args.llama_cpp else []
    for batch in args.batches:
        runs = {engine: in_fresh_process(context, measure, engine, batch, args.new_tokens, args.repeats,
                                         args.threads)
                for engine in ("cartridges", EXACT, "transformers")}
        if args.llama_cpp:
            runs["llama.cpp"] = in_fresh_process(context, measure_llama_cpp, prompts[:batch], args.new_tokens,
                                                 args.repeats, threads)
        mine = runs["cartridges"]
        # Our row counts the sequences identical to transformers' (as always), llama.cpp's row those
        # identical to ours: informational, as llama.cpp rounds activations to 8 bits and its KV cache
        # to float16, which flips near-ties between the top two tokens (seen on 2 of the 8 prompts).
        same = {"cartridges": same_tokens(mine, runs["transformers"]),
                EXACT: same_tokens(runs[EXACT], runs["transformers"])}
        if args.llama_cpp:
            same["llama.cpp"] = same_tokens(mine, runs["llama.cpp"])
        for name, r in runs.items():
            print(f"{batch:>5} {name:>13} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} {r.peak_mib:>9.0f} "
                  f"{same.get(name, ''):>12}")
        print_ratio(batch, "ratio", mine, runs["transformers"])
        if args.llama_cpp:
            print_ratio(batch, "vs llama.cpp", mine, runs["llama.cpp"])


if __name__ == "__main__":
    main()
