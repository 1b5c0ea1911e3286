"""Quality against KV: each condition of `eval_long.py` runs on one document as a point, the
share of the oracle's log p gain it recovers against the KV a request reads (a cartridge's
tokens, the parts a composition decodes, the passages or the corpus' beginning in the prompt).

    python benchmarks/plot_kv.py --doc chronicle benchmarks/results/eval_long_chronicle_*.json \\
        --out docs/images/kv_chronicle.png

Every condition of every run given is a point, except the untrained initialization; where two
runs give the same point's label (a baseline scored in several runs) the first is kept. A
cartridge is labelled by its tokens, parts by their count and tokens each. Prints the points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Where a point's marker and colour come from: what a user would build (the baselines) apart from cartridges.
BASELINES = {"truncation", "retrieval", "oracle", "none"}


def points(doc: str, paths: list[Path]) -> list[dict]:
    """(label, condition, KV tokens a request reads, recovered, exact-answer rate) per condition, first label kept."""
    found: dict[str, dict] = {}
    for path in paths:
        run = json.loads(path.read_text())["documents"].get(doc)
        if run is None:
            continue
        tokens = (run.get("config") or {}).get("num_tokens")
        parts = run.get("parts") or {}
        recovered_of = dict(run["recovered"])
        if "oracle" in run["conditions"]:  # the scale's own top, 1 by definition
            recovered_of["oracle"] = {"all": 1.0}
        for condition, recovered in recovered_of.items():
            if condition in ("init", "none"):
                continue
            label = condition
            if condition.startswith("parts"):
                sizes = parts.get("cartridge_tokens") or []
                label = f"{condition}: {len(sizes)} x {sizes[0] if sizes else '?'}"
            elif condition.startswith("cartridge"):
                label = f"{condition}: {tokens}"
            measured = run["conditions"][condition]
            found.setdefault(label, {"label": label, "condition": condition, "kv_tokens": measured["kv_tokens"],
                                     "recovered": recovered["all"], "exact": measured["match"],
                                     "file": path.name})
    return sorted(found.values(), key=lambda p: (p["kv_tokens"], -p["recovered"]))  # the higher of two labelled first


def plot(doc: str, found: list[dict], bytes_per_token: int | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5))
    placed: list[tuple[float, float]] = []  # where labels went: a point next to another one gets its label below
    for p in found:
        baseline = p["condition"] in BASELINES
        ax.scatter(p["kv_tokens"], p["recovered"], marker="s" if baseline else "o",
                   color="tab:gray" if baseline else ("tab:green" if "retrieval" in p["condition"] else "tab:blue"))
        near = sum(abs(x / p["kv_tokens"] - 1) < 0.15 and abs(y - p["recovered"]) < 0.03 for x, y in placed)
        placed.append((p["kv_tokens"], p["recovered"]))
        ax.annotate(p["label"], (p["kv_tokens"], p["recovered"]), textcoords="offset points",
                    xytext=(5, 4 - 11 * near), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV tokens a request reads (log scale)")
    ax.set_ylabel("recovered: share of the oracle's log p gain over no context")
    ax.axhline(0.6, color="tab:red", linestyle=":", linewidth=1)
    ax.grid(alpha=0.3)
    if bytes_per_token:
        top = ax.secondary_xaxis("top", functions=(lambda t: t * bytes_per_token / 2**20,
                                                    lambda m: m * 2**20 / bytes_per_token))
        top.xaxis.set_major_formatter(ScalarFormatter())
        top.xaxis.set_minor_formatter(ScalarFormatter())
        top.set_xlabel("KV MiB (float32)")
    ax.set_title(f"{doc}: quality against KV (squares: what a user builds instead; dotted: issue 28's 0.6)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="eval_long.py result JSONs")
    parser.add_argument("--doc", required=True, help="the document whose conditions to plot")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    found = points(args.doc, args.files)
    if not found:
        raise SystemExit(f"no run of '{args.doc}' in the files given")
    bytes_per_token = None
    for path in args.files:
        kv = json.loads(path.read_text())["documents"].get(args.doc, {}).get("kv") or {}
        if kv.get("cartridge_tokens"):
            bytes_per_token = kv["cartridge_bytes"] // kv["cartridge_tokens"]
            break
    for p in found:
        print(f"{p['label']:<40} {p['kv_tokens']:>8.0f} KV tokens  {p['recovered']:5.2f} / {p['exact']:.2f}  {p['file']}")
    plot(args.doc, found, bytes_per_token, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
