"""What holds a long corpus' weak sections under the 0.3 floor: for each section whose recovered
share of the oracle's gain is under `--floor` in a result file of `eval_long.py`, the oracle's
gain there, the question that weighs most against it (and that question's gain over no context:
negative where the cartridge is worse than no context at all) and the section's share without
that one question; then how many questions of the whole file the cartridge answers more than a
nat a token worse than no context.

    python benchmarks/weak_sections.py benchmarks/results/eval_long_chronicle_parts9k.json [...]
        [--condition parts] [--floor 0.3] [--against BASELINE.json]

With `--against`, a run of the same document under other settings: the questions either run
answers more than a nat a token below no context, with their gain over no context in both.

A section holds 6-9 questions (multi-hop ones count for both of theirs), so one question can
decide its share; this says whether the misses are forgotten sections (every question near no
context) or wrong recall (one answer pulled below no context), and how firm the count of
sections under the floor is: each section's questions drawn again with replacement (`--draws`
times, every section at once), the share of draws in which a weak section stays under the floor,
and the range of the count over the draws.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from evaluation import recovered, summary  # this script's sibling, as eval_long imports it


def per_token(questions: list[dict], condition: str) -> float:
    """Log p of the gold answers per token over `questions`, as the suite sums a section."""
    rows = [q[condition] for q in questions]
    return summary(rows, list(range(len(rows))))["loglik_per_token"]


def share(questions: list[dict], condition: str) -> float:
    """The recovered share of the oracle's gain over `questions`, as the suite's section figure."""
    return recovered(per_token(questions, condition), per_token(questions, "none"), per_token(questions, "oracle"))


def gain(question: dict, condition: str) -> float:
    """The question's gain over no context under `condition`, in nats a token."""
    return (question[condition]["loglik"] - question["none"]["loglik"]) / question["none"]["answer_tokens"]


def drawn_shares(questions: list[dict], condition: str, draws: int, rng: np.random.Generator) -> np.ndarray:
    """The section's share over `draws` draws of its questions with replacement. The share of a
    set of questions is (sum of condition - sum of none) / (sum of oracle - sum of none) over
    their log p (per token, the tokens cancel), as `share` computes it."""
    logliks = np.array([[q[c]["loglik"] for c in (condition, "none", "oracle")] for q in questions])
    drawn = logliks[rng.integers(0, len(questions), size=(draws, len(questions)))].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (drawn[:, 0] - drawn[:, 1]) / (drawn[:, 2] - drawn[:, 1])


def report(path: Path, condition: str, floor: float, draws: int = 2000) -> tuple[int, int]:
    """Prints one document's weak sections; returns (weak sections, those at the floor without one question)."""
    weak = lifted = 0
    rng = np.random.default_rng(0)
    for name, d in json.loads(path.read_text())["documents"].items():
        if condition not in d.get("recovered", {}):
            print(f"{path.name} {name}: no condition {condition!r}")
            continue
        questions = d["per_question"]
        below = sum(gain(q, condition) < -1.0 for q in questions)
        print(f"\n{path.name} {name} ({condition}): {below} of {len(questions)} questions over a nat a token "
              f"below no context")
        print("| section | questions | oracle gain, nats/token | share | under the floor in draws | "
              "the question that weighs most | its gain over none | share without it |\n"
              "|---|---|---|---|---|---|---|---|")
        by_section = d["recovered"][condition]["by_section"]
        of_section = {section: [q for q in questions if int(section) in q["sections"]] for section in by_section}
        under = {section: drawn_shares(own, condition, draws, rng) < floor for section, own in of_section.items()}
        for section, value in by_section.items():
            if not value < floor:
                continue
            own = of_section[section]
            chance = f"{under[section].mean():.0%}"
            if len(own) < 2:
                print(f"| {section} | {len(own)} | | {value:.2f} | {chance} | (one question: nothing to leave out) | | |")
                weak += 1
                continue
            without, worst = max(((share([q for q in own if q is not x], condition), x) for x in own),
                                 key=lambda t: t[0])
            oracle_gain = per_token(own, "oracle") - per_token(own, "none")
            weak, lifted = weak + 1, lifted + (without >= floor)
            print(f"| {section} | {len(own)} | {oracle_gain:.2f} | {value:.2f} | {chance} | {worst['kind']}: "
                  f"{worst['answer']} (reply: {worst[condition]['reply'][:60]!r}) | {gain(worst, condition):.1f} | "
                  f"{without:.2f} |")
        counts = np.sum(list(under.values()), axis=0)
        low, median, high = np.percentile(counts, [5, 50, 95])
        print(f"\nsections under {floor}: {sum(v < floor for v in by_section.values())} of {len(by_section)}; with "
              f"each section's questions drawn again ({draws} draws): median {median:.0f}, 90% of draws "
              f"{low:.0f}-{high:.0f}")
    return weak, lifted


def compare(path: Path, baseline: Path, condition: str) -> tuple[int, int, int]:
    """Prints the questions that `path` or `baseline` answers over a nat a token below no context,
    with their gain in both; returns (below in the baseline, below in `path`, in both)."""
    ours = json.loads(path.read_text())["documents"]
    theirs = json.loads(baseline.read_text())["documents"]
    counts = [0, 0, 0]
    for name in ours.keys() & theirs.keys():
        pairs = [(q, b) for q, b in zip(ours[name]["per_question"], theirs[name]["per_question"], strict=True)
                 if condition in q and condition in b]
        if not all(q["question"] == b["question"] for q, b in pairs):
            raise SystemExit(f"{path.name} and {baseline.name} do not hold the same questions of {name}")
        print(f"\n{name}: questions over a nat a token below no context in either run ({condition}), "
              f"gain over none\n| section | kind | answer | {baseline.name} | {path.name} |\n|---|---|---|---|---|")
        for q, b in pairs:
            now, before = gain(q, condition), gain(b, condition)
            if now < -1.0 or before < -1.0:
                counts[0] += before < -1.0
                counts[1] += now < -1.0
                counts[2] += before < -1.0 and now < -1.0
                sections = ", ".join(map(str, q["sections"]))
                print(f"| {sections} | {q['kind']} | {q['answer']} | {before:.1f} | {now:.1f} |")
    print(f"\nbelow in {baseline.name}: {counts[0]}; in {path.name}: {counts[1]}; in both: {counts[2]}")
    return counts[0], counts[1], counts[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="result files of eval_long.py")
    parser.add_argument("--condition", default="parts")
    parser.add_argument("--floor", type=float, default=0.3)
    parser.add_argument("--against", type=Path, help="a baseline result file of the same document(s)")
    parser.add_argument("--draws", type=int, default=2000, help="draws of each section's questions (default 2000)")
    args = parser.parse_args()
    weak = lifted = 0
    for path in args.results:
        w, l = report(path, args.condition, args.floor, args.draws)
        weak, lifted = weak + w, lifted + l
    print(f"\n{weak} sections under {args.floor}; {lifted} reach it without their one question that weighs most")
    if args.against is not None:
        for path in args.results:
            compare(path, args.against, args.condition)


if __name__ == "__main__":
    main()
