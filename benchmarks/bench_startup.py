"""Start-up: how long `cartridges.load_model()` of the default model takes, and how long a
server takes from its start to answering `/health` with 200 (healthy).

    .venv/bin/python benchmarks/bench_startup.py [--repeats 5] [--make-serve]

Each figure is the median of `repeats` fresh processes (nothing cached in Python; the file
in the page cache, as on any start after the first). Beside the loader, in the same
processes, the reference it replaced: the `gguf` package's `GGUFReader` for the header and
its numpy `dequantize` for every tensor. The server is `cartridges serve` on a fresh data
directory and port, or with --make-serve `make serve` as the README starts it (make's checks
of the build included). Targets (issue 32): load ≤ 2 s, server ready ≤ 4 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_files import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "startup.json"

# Run in a fresh interpreter: the import of the package, then the two loaders, each timed.
_LOAD = r"""
import json, time
t0 = time.perf_counter()
import cartridges
from cartridges.models import default_model_path
t1 = time.perf_counter()
model = cartridges.load_model()
t2 = time.perf_counter()
from gguf import GGUFReader
from gguf.quants import dequantize
reader = GGUFReader(default_model_path())
metadata = {key: field.contents() for key, field in reader.fields.items()}
t3 = time.perf_counter()
for tensor in reader.tensors:
    dequantize(tensor.data, tensor.tensor_type)
t4 = time.perf_counter()
from cartridges.models.gguf_file import read_gguf
t5 = time.perf_counter()
read_gguf(default_model_path())
t6 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load_model": t2 - t1, "reference_header": t3 - t2,
                  "reference_dequantize": t4 - t3, "header": t6 - t5}))
"""


def time_load() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_server(make_serve: bool) -> float:
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        env = dict(os.environ, CARTRIDGES_DATA_DIR=data_dir)
        if make_serve:
            cmd = ["make", "-s", "serve", f"PORT={port}"]
        else:
            cmd = [sys.executable, "-m", "cartridges.cli", "serve", "--port", str(port), "--log-level", "warning"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        return time.perf_counter() - start
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.perf_counter() - start > 120:
                    raise RuntimeError("the server did not become healthy")
                time.sleep(0.02)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--make-serve", action="store_true", help="start the server with `make serve`")
    args = parser.parse_args()

    loads = [time_load() for _ in range(args.repeats)]
    load = {key: statistics.median(run[key] for run in loads) for key in loads[0]}
    reference = load["reference_header"] + load["reference_dequantize"]
    servers = [time_server(args.make_serve) for _ in range(args.repeats)]
    ready = statistics.median(servers)

    print(f"import cartridges                {load['import']:6.2f} s")
    print(f"load_model() (default model)     {load['load_model']:6.2f} s   target ≤ 2 s")
    print(f"  header: ours / gguf's reader   {load['header']:6.3f} s / {load['reference_header']:.3f} s "
          f"({load['reference_header'] / load['header']:.0f}x faster)")
    print(f"  reference loader (gguf header + numpy dequantize) {reference:.2f} s "
          f"({reference / load['load_model']:.1f}x load_model's whole time)")
    how = "make serve" if args.make_serve else "cartridges serve"
    print(f"server healthy after start ({how}) {ready:6.2f} s   target ≤ 4 s "
          f"(min {min(servers):.2f}, max {max(servers):.2f})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"repeats": args.repeats, "load": load, "loads": loads,
                                   "server_start": how, "server_ready": servers}, indent=1) + "\n")


if __name__ == "__main__":
    main()
