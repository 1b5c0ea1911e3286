"""Where a decode step's time goes: ATen operators of the engine's compute thread under the
PyTorch profiler, while it decodes a batch of B requests on the default model.

    python benchmarks/profile_decode.py [--batch 1,16] [--new-tokens 64] [--top 12]

Prints, per batch size, the wall time per step and the operators with the largest self CPU
time (our quantized kernel and the decode attention kernel run inside `aten::` calls' parents:
they show under the operator that calls them, see the notes printed below the table).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cartridges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    model = cartridges.load_model()
    prompt = model.encode_chat([{"role": "user", "content": "Describe the water cycle, step by step."}])
    for batch in (int(b) for b in args.batch.split(",")):
        model.generate([prompt] * batch, max_new_tokens=4, stop_token_ids=[])  # warm-up
        steps_before = model.engine.stats().steps
        # The engine computes on its own thread: profile every thread, not only this one.
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            start = time.perf_counter()
            model.generate([prompt] * batch, max_new_tokens=args.new_tokens, stop_token_ids=[])
            wall = time.perf_counter() - start
        steps = model.engine.stats().steps - steps_before
        print(f"\nbatch {batch}: {steps} steps, {wall / steps * 1e3:.1f} ms per step, "
              f"{batch * args.new_tokens / wall:.1f} tok/s")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
        print(table)


if __name__ == "__main__":
    main()
