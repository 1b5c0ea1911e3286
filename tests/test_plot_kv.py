"""benchmarks/plot_kv.py puts every condition of the long-corpus suite's runs of one document
as a point of quality against the KV a request reads, and draws them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(conditions: dict[str, tuple[float, float]], num_tokens: int | None = None, parts: list[int] | None = None) -> dict:
    """A result of eval_long.py for document "doc": condition -> (KV tokens, recovered)."""
    doc = {"conditions": {c: {"kv_tokens": kv, "match": 0.25} for c, (kv, _) in conditions.items()},
           "recovered": {c: {"all": r} for c, (_, r) in conditions.items() if c != "oracle"},
           "config": {"num_tokens": num_tokens} if num_tokens else {},
           "kv": {"cartridge_tokens": 1024, "cartridge_bytes": 1024 * 46080}}
    if parts:
        doc["parts"] = {"cartridge_tokens": parts}
    return {"documents": {"doc": doc}}


def test_each_condition_is_a_point_labelled_by_its_size(tmp_path):
    baselines = run({"none": (0, 0.0), "oracle": (1600, 0.0), "retrieval": (960, 0.97), "init": (1024, 0.2)})
    cartridge = run({"none": (0, 0.0), "retrieval": (960, 0.5), "cartridge": (1024, 0.61)}, num_tokens=1024)
    parts = run({"parts": (4096, 0.66)}, num_tokens=1024, parts=[1024] * 4)
    paths = []
    for name, result in (("baselines", baselines), ("cartridge", cartridge), ("parts", parts)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    out_png = tmp_path / "kv.png"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "plot_kv.py"), "--doc", "doc", *map(str, paths),
                          "--out", str(out_png)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    # Sorted by KV; the oracle at 1 by definition; the first run's retrieval kept; no initialization, no "none".
    assert [line.split()[0] for line in lines[:-1]] == ["retrieval", "cartridge:", "oracle", "parts:"]
    assert "0.97" in lines[0] and "1.00" in lines[2]
    assert lines[1].startswith("cartridge: 1024") and lines[3].startswith("parts: 4 x 1024")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
