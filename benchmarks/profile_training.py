"""Where the training loop's time goes: `cartridges_core.train_cartridge`, the loop `cartridges
train` runs (length groups, the companion, Adam, checkpoints), on random conversations of the
shapes the long-corpus defaults train on, timed per optimizer step and then profiled.

    python benchmarks/profile_training.py [--device cpu|cuda] [--cartridge-tokens 1024]
        [--row-tokens 180] [--steps 40] [--profile-steps 10] [--no-checkpoint] [--top 20]

The conversations' lengths are drawn around `--row-tokens` (from half to one and a half times
it), with their last 70% as targets and a random top-k teacher: the loop's cost depends on the
shapes, not on the text. The options are the defaults' for a corpus beyond the context
(`TrainConfig().for_corpus(...)`), the model's dtype for training decided as `cartridges train`
decides it. Printed: seconds per step (median over `--steps`, after two warm-up steps), the same
with no checkpoint written, and the operators with the largest self time over
`--profile-steps` steps (device time first on a GPU, then host time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cartridges
import cartridges_core
from cartridges.selfstudy import TrainConfig
from cartridges.training import _loop_options, decided_config, training_twin

LONG_CORPUS_TOKENS = 53_509  # the chronicle's length: the defaults a corpus beyond the context gets


def random_data(vocab: int, rows: int, row_tokens: int, top_k: int, seed: int = 0) -> cartridges_core.TrainingData:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(row_tokens // 2, row_tokens * 3 // 2 + 1, (rows,), generator=g)
    width = int(lengths.max())
    tokens = torch.randint(vocab, (rows, width), generator=g)
    positions = torch.arange(width).unsqueeze(0)
    first_target = (lengths * 3 // 10).unsqueeze(1)
    mask = (positions >= first_target) & (positions < (lengths - 1).unsqueeze(1))
    targets = int(mask.sum())
    ids = torch.randint(vocab, (targets, top_k), generator=g)
    logprobs = torch.log_softmax(torch.randn(targets, top_k, generator=g), -1)
    return cartridges_core.TrainingData(tokens, lengths, mask, ids, logprobs)


def step_times(trainer, params, data, options) -> list[float]:
    """Wall seconds of each optimizer step of one `train_cartridge` run."""
    stamps = [time.perf_counter()]

    def report(_progress) -> bool:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return True

    cartridges_core.train_cartridge(trainer, params, data, options, report, None)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cartridge-tokens", type=int, default=1024)
    parser.add_argument("--row-tokens", type=int, default=180, help="mean conversation length (default: 180)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps timed (default: 40)")
    parser.add_argument("--profile-steps", type=int, default=10, help="optimizer steps profiled (default: 10)")
    parser.add_argument("--no-checkpoint", action="store_true", help="time only the run without checkpoints")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads")
    parser.add_argument("--top", type=int, default=20, help="operators to list (default: 20)")
    args = parser.parse_args()
    if min(args.steps, args.profile_steps, args.cartridge_tokens, args.row_tokens) < 1:
        parser.error("--steps, --profile-steps, --cartridge-tokens and --row-tokens must be positive")
    torch.set_num_threads(args.threads)

    model = cartridges.load_model(device=args.device)
    native = model.native
    config = decided_config(TrainConfig(num_tokens=args.cartridge_tokens), LONG_CORPUS_TOKENS, native)
    trainer = training_twin(native, config.training_dtype)
    per_step = config.batch_size * config.grad_accum
    vocab = native.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefix = trainer.prefix_from_tokens(torch.randint(vocab, (args.cartridge_tokens,), generator=g))

    def run(steps: int, checkpoint: str | None) -> list[float]:
        params = cartridges_core.CartridgeParams(prefix, config.num_frozen)
        data = random_data(vocab, per_step * steps, args.row_tokens, config.top_k)
        options = _loop_options(model, trainer, config.replace(epochs=1), params, data, checkpoint, False)
        return step_times(trainer, params, data, options)

    print(f"{args.device}, training in {trainer.dtype}, {torch.get_num_threads()} threads; a step: {per_step} "
          f"conversations of {args.row_tokens // 2}-{args.row_tokens * 3 // 2} tokens (batch {config.batch_size} x "
          f"accumulation {config.grad_accum}) behind a {args.cartridge_tokens}-token cartridge, companion every "
          f"{config.companion_every} rows, top-{config.top_k} teacher")
    warm = 2
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"no checkpoint": None} if args.no_checkpoint else {
            "checkpoint every 10 steps": os.path.join(tmp, "ckpt"), "no checkpoint": None}
        for name, path in runs.items():
            times = run(args.steps + warm, path)[warm:]
            print(f"{name:26s} {statistics.median(times):.4f} s a step (median of {len(times)}; "
                  f"mean {statistics.mean(times):.4f}, max {max(times):.4f})")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        run(args.profile_steps, None)
    averages = prof.key_averages()
    if args.device == "cuda":
        print(averages.table(sort_by="self_cuda_time_total", row_limit=args.top))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
