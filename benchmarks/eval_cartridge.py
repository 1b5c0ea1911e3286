"""Cartridge evaluation suite: does a cartridge trained by self-study stand in for its document?

Four hand-written documents of invented facts (benchmarks/eval_docs/: a handbook of rules, a
report made of tables, a narrative, a technical manual), each with 40+ held-out questions and
gold answers, about half of them phrased unlike the text (paraphrase, a fact reached through
another, yes/no, a number computed from two stated ones). Training never sees the questions.

Per document, on the default model, the gold answer's log-likelihood as the start of the reply
and a contains-match of the greedy reply, under these conditions:
  none        no context
  in_context  the whole document in the system prompt (the target)
  truncated   the document cut so that its prompt KV has as many tokens as the cartridge
  init        the untrained cartridge (its initialization: KV of the first corpus tokens)
  cartridge   the cartridge trained by self-study
"recovered" = (condition - none) / (in_context - none) on the per-token log-likelihood.
Also KV bytes (cartridge vs the document in context) and synthesis and training wall times.
Averages are given apart for the tuning documents (--tune; choose settings on these only) and
the held-out ones (the honest figure).

Composition (--compose A,B): the cartridges of A and B in one request, composed by mixture (the
default) and by concatenation; for each document's questions, the fraction of its
single-cartridge gain kept (target >= 0.8, on the default). With --baselines-only it composes
the untrained (init) cartridges.

    python benchmarks/eval_cartridge.py --threads 2 --out results.json          # the full suite
    python benchmarks/eval_cartridge.py --baselines-only                        # no training
    python benchmarks/eval_cartridge.py --quick --docs manual                   # smoke run
    python benchmarks/eval_cartridge.py --set num_samples=512 --set epochs=2 --docs handbook,report
    python benchmarks/eval_cartridge.py --compose handbook,narrative --cartridge-dir runs/carts

Trained cartridges are kept in --cartridge-dir under a key of (model, document, config), with
their training stats beside them; a re-run with the same settings loads them instead of
training again, and an interrupted training resumes from its checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cartridges.cartridge import Cartridge
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.training import init_params
from evaluation import (Condition, Question, add_recovered, cached_result, check_question, document_prompt, evaluate,
                        for_text, get_cartridge, kv_bytes_per_token, parse_overrides, suite_arguments,
                        suite_model, truncated_document)

DOCS_DIR = Path(__file__).resolve().parent / "eval_docs"
ALL_DOCS = ("handbook", "report", "narrative", "manual")
DEFAULT_TUNE = ("handbook", "report")
KINDS = ("literal", "paraphrase", "indirect", "yes_no", "computed")
CONDITIONS = ("none", "in_context", "truncated", "init", "cartridge")

# --quick: enough to run every stage end to end in a few minutes on one core, not to learn.
QUICK_CONFIG = dict(num_samples=16, synthesis_batch_size=8, chunk_tokens=256,
                    max_question_tokens=32, max_answer_tokens=48, epochs=1, batch_size=4)
QUICK_QUESTIONS = 10


# -- documents ------------------------------------------------------------------------------

@dataclass
class Document:
    name: str
    text: str
    questions: list[Question]


def load_document(name: str, docs_dir: Path = DOCS_DIR) -> Document:
    text = (docs_dir / f"{name}.md").read_text()
    raw = json.loads((docs_dir / f"{name}.questions.json").read_text())
    questions = [Question(q["question"], q["answer"], q["kind"], tuple(q.get("aliases", ()))) for q in raw]
    for q in questions:
        check_question(name, q, text, KINDS)
    return Document(name, text, questions)


def select_questions(questions: list[Question], n: int) -> list[Question]:
    """All questions (n = 0), or n of them taken in turn from each kind, in file order."""
    if not n or n >= len(questions):
        return list(questions)
    queues = {k: [q for q in questions if q.kind == k] for k in KINDS}
    picked: list[Question] = []
    while len(picked) < n:
        for k in KINDS:
            if queues[k] and len(picked) < n:
                picked.append(queues[k].pop(0))
    return [q for q in questions if any(q is p for p in picked)]


# -- cartridges -----------------------------------------------------------------------------

def baseline_cached(model, doc: Document, questions: list[Question], config: TrainConfig, name: str, args,
                    run) -> dict:
    """`run()`, the figures of condition `name`, kept in --cartridge-dir for the conditions that
    do not depend on training (all but "cartridge"): they depend on the model, the document,
    the questions, the cartridge's size and initialization, and the reply length only."""
    if name == "cartridge":
        return run()
    key = [model.fingerprint, doc.text, [q.cache_key() for q in questions], name, config.num_tokens,
           config.num_frozen, config.init, args.max_reply]
    return cached_result(args.cartridge_dir, f"{doc.name}-{name}", key, run)


def init_cartridge(model, doc: Document, config: TrainConfig) -> Cartridge:
    config = for_text(model, doc.text, config)
    params = init_params(model, Corpus.from_texts(model.tokenizer, [doc.text]), config)
    return Cartridge.from_params(params, model.fingerprint, config.to_dict())


# -- the suite ------------------------------------------------------------------------------

def evaluate_document(model, doc: Document, config: TrainConfig, args, split: str,
                      memo: dict) -> tuple[dict, Cartridge | None]:
    questions = select_questions(doc.questions, args.max_questions)
    per_token = kv_bytes_per_token(model)
    config = for_text(model, doc.text, config)
    init = init_cartridge(model, doc, config)
    cut, cut_tokens = truncated_document(model, doc.text, init.num_tokens)
    conditions = {
        "none": Condition(),
        "in_context": Condition(system=document_prompt(doc.text)),
        "truncated": Condition(system=document_prompt(cut)),
        "init": Condition(prefixes=(init.prefix(model),)),
    }
    cart, train_stats = None, {}
    if not args.baselines_only:
        cart, train_stats = get_cartridge(model, doc.name, doc.text, config, args.cartridge_dir)
        conditions["cartridge"] = Condition(prefixes=(cart.prefix(model),))
    results = {}
    for name, cond in conditions.items():
        results[name] = baseline_cached(model, doc, questions, config, name, args,
                                        lambda cond=cond: evaluate(model, questions, cond, args.max_reply))
        memo[(doc.name, name)] = results[name]
        r = results[name]
        print(f"[{doc.name}] {name:10s} loglik/token {r['loglik_per_token']:7.3f}  match {r['match']:.3f}  "
              f"kv {r['kv_tokens']:5d} tokens  ({r['eval_s']:.0f} s)", file=sys.stderr)
    in_context_kv = results["in_context"]["kv_tokens"] * per_token
    cart_kv = (cart or init).nbytes
    return {
        "split": split,
        "document_tokens": len(model.tokenizer.encode(doc.text)),
        "questions": len(questions),
        "kinds": {k: sum(q.kind == k for q in questions) for k in KINDS},
        "kv": {
            "in_context_tokens": results["in_context"]["kv_tokens"],
            "in_context_bytes": in_context_kv,
            "cartridge_tokens": (cart or init).num_tokens,
            "cartridge_bytes": cart_kv,
            "ratio": in_context_kv / cart_kv,
            "truncated_tokens": results["truncated"]["kv_tokens"],
            "truncated_document_tokens": cut_tokens,
        },
        "synthesis_s": train_stats.get("synthesis_s"),
        "training_s": train_stats.get("training_s"),
        "train_stats": train_stats,
        "conditions": {name: {k: v for k, v in r.items() if k != "per_question"} for name, r in results.items()},
        "recovered": add_recovered(results, "in_context"),
        "per_question": [
            {"question": q.question, "answer": q.answer, "kind": q.kind,
             **{name: r["per_question"][i] for name, r in results.items()}}
            for i, q in enumerate(questions)
        ],
    }, cart


def average(docs: list[dict]) -> dict | None:
    if not docs:
        return None

    def mean(values):
        values = [v for v in values if v is not None and not math.isnan(v)]
        return sum(values) / len(values) if values else None

    conds = docs[0]["conditions"].keys()
    out = {
        "documents": len(docs),
        "loglik_per_token": {c: mean(d["conditions"][c]["loglik_per_token"] for d in docs) for c in conds},
        "match": {c: mean(d["conditions"][c]["match"] for d in docs) for c in conds},
        "recovered": {c: mean(d["recovered"][c]["all"] for d in docs) for c in docs[0]["recovered"]},
        "recovered_by_kind": {c: {k: mean(d["recovered"][c]["by_kind"].get(k) for d in docs) for k in KINDS}
                              for c in docs[0]["recovered"]},
        "kv_ratio": mean(d["kv"]["ratio"] for d in docs),
    }
    if docs[0]["synthesis_s"] is not None:
        out["synthesis_s"] = mean(d["synthesis_s"] for d in docs)
        out["training_s"] = mean(d["training_s"] for d in docs)
    return out


def compose(model, docs: dict[str, Document], names: list[str], carts: dict[str, Cartridge], args, label: str,
            memo: dict) -> dict:
    """Each document's questions with its own cartridge, and with both in one request ([A, B]),
    composed by mixture (the default) and by concatenation, and the fraction of the
    single-cartridge gain (over no context) that each keeps. ([B, A] gives the same numbers:
    keys carry their positions (RoPE) and attention does not see their order; the mixture
    has none.)
    `label` is the condition name of these cartridges ("init" or "cartridge"): figures the
    document's own evaluation already made are taken from `memo`."""
    a, b = names
    out = {"cartridges": label, "order": [a, b], "documents": {}}
    for name in names:
        doc = docs[name]
        questions = select_questions(doc.questions, args.max_questions)
        pa, pb = carts[a].prefix(model), carts[b].prefix(model)

        def run(key: tuple[str, str], cond: Condition) -> dict:
            if key not in memo:
                memo[key] = evaluate(model, questions, cond, args.max_reply)
            return memo[key]

        runs = {
            "none": run((name, "none"), Condition()),
            "single": run((name, label), Condition(prefixes=(carts[name].prefix(model),))),
            f"{a}+{b}": run((name, f"{label}:{a}+{b}"), Condition(prefixes=(pa, pb))),
            f"{a}+{b} concatenated": run((name, f"{label}:{a}+{b}:concatenated"),
                                         Condition(prefixes=(pa, pb), composition="concatenate")),
        }
        none = runs["none"]["loglik_per_token"]
        gain = runs["single"]["loglik_per_token"] - none
        entry = {"single_gain": gain}
        for key, r in runs.items():
            entry[key] = {"loglik_per_token": r["loglik_per_token"], "match": r["match"]}
            if key not in ("none", "single"):
                entry[key]["gain_kept"] = (r["loglik_per_token"] - none) / gain if gain > 0 else None
        out["documents"][name] = entry
        kept = {key: entry[key]["gain_kept"] for key in runs if key not in ("none", "single")}
        print(f"[compose {label}] {name}: single gain {gain:.3f}, kept: "
              + ", ".join(f"{key} {'n/a' if v is None else f'{v:.3f}'}" for key, v in kept.items()), file=sys.stderr)
    kept = [out["documents"][n][f"{a}+{b}"]["gain_kept"] for n in names]
    out["min_gain_kept"] = None if None in kept else min(kept)
    out["target_met"] = None if None in kept else min(kept) >= 0.8
    return out


def check_docs(model, names: list[str]) -> int:
    """The suite's rules for its documents: 2,000-6,000 tokens, 30+ questions, at least a third
    of them not literal (load_document checks kinds, yes/no answers and literal answers)."""
    failures = 0
    for name in names:
        doc = load_document(name)
        tokens = len(model.tokenizer.encode(doc.text))
        kinds = {k: sum(q.kind == k for q in doc.questions) for k in KINDS}
        non_literal = len(doc.questions) - kinds["literal"]
        ok = 2000 <= tokens <= 6000 and len(doc.questions) >= 30 and 3 * non_literal >= len(doc.questions)
        failures += not ok
        print(f"{name}: {tokens} tokens, {len(doc.questions)} questions {kinds}, "
              f"{non_literal} not literal: {'ok' if ok else 'FAILS the rules'}")
    return 1 if failures else 0


def print_table(report: dict) -> None:
    """Markdown tables of the figures, as benchmarks/README.md records them."""
    docs = report["documents"]
    conds = [c for c in CONDITIONS if any(c in d["conditions"] for d in docs.values())]
    print("\n| document | split | tokens | questions | " + " | ".join(f"{c} loglik/match" for c in conds)
          + " | recovered " + " / ".join(c for c in conds if c not in ("none", "in_context")) + " | KV ratio |")
    print("|" + "---|" * (6 + len(conds)))
    for name, d in docs.items():
        cells = [f"{d['conditions'][c]['loglik_per_token']:.2f} / {d['conditions'][c]['match']:.2f}" for c in conds]
        rec = " / ".join(f"{d['recovered'][c]['all']:.2f}" for c in conds if c not in ("none", "in_context"))
        print(f"| {name} | {d['split']} | {d['document_tokens']} | {d['questions']} | " + " | ".join(cells)
              + f" | {rec} | {d['kv']['ratio']:.1f}× |")
    for split, avg in report["averages"].items():
        if avg is None:
            continue
        cells = [f"{avg['loglik_per_token'][c]:.2f} / {avg['match'][c]:.2f}" for c in conds]
        rec = " / ".join(f"{avg['recovered'][c]:.2f}" for c in conds if c not in ("none", "in_context"))
        print(f"| **{split} average** | | | | " + " | ".join(cells) + f" | {rec} | {avg['kv_ratio']:.1f}× |")


def run_suite(model, docs: dict[str, Document], config: TrainConfig, args) -> dict[str, Any]:
    """Every document of --docs under every condition (training its cartridge with `config`
    unless --baselines-only), the averages by split, and --compose's composition."""
    report: dict[str, Any] = {
        "model": model.name, "device": args.device, "threads": args.threads, "quick": args.quick,
        "baselines_only": args.baselines_only,
        "config": None if args.baselines_only else config.to_dict(), "init_config": config.to_dict(),
        "tune": args.tune, "documents": {},
    }
    carts: dict[str, Cartridge] = {}
    inits: dict[str, Cartridge] = {}
    memo: dict[tuple[str, str], dict] = {}  # (document, condition) -> evaluate()'s figures
    for name in args.docs:
        split = "tune" if name in args.tune else "held_out"
        report["documents"][name], cart = evaluate_document(model, docs[name], config, args, split, memo)
        if cart is not None:
            carts[name] = cart
    by_split = {s: [d for d in report["documents"].values() if d["split"] == s] for s in ("tune", "held_out")}
    report["averages"] = {"tune": average(by_split["tune"]), "held_out": average(by_split["held_out"]),
                          "all": average(list(report["documents"].values()))}
    if args.compose:
        for name in args.compose:
            inits[name] = init_cartridge(model, docs[name], config)
            if not args.baselines_only and name not in carts:
                carts[name] = get_cartridge(model, docs[name].name, docs[name].text, config, args.cartridge_dir)[0]
        report["composition"] = {"init": compose(model, docs, args.compose, inits, args, "init", memo)}
        if not args.baselines_only:
            report["composition"]["trained"] = compose(model, docs, args.compose, carts, args, "cartridge", memo)
    print_table(report)
    return report


def across_seeds(reports: dict[int, dict]) -> dict[str, Any]:
    """What several seeds say together: per document the trained cartridge's recovered under
    each seed, their mean and the worst, and whether it beat its initialization under every
    seed; the mean by split over documents and seeds; the worst composition kept."""
    first = next(iter(reports.values()))
    out: dict[str, Any] = {"seeds": list(reports), "documents": {}, "splits": {}}
    for name, doc in first["documents"].items():
        if "cartridge" not in doc["recovered"]:
            continue
        each = [r["documents"][name]["recovered"]["cartridge"]["all"] for r in reports.values()]
        init = doc["recovered"]["init"]["all"]
        out["documents"][name] = {"split": doc["split"], "recovered": each, "mean": sum(each) / len(each),
                                  "worst": min(each), "init": init, "above_init_every_seed": min(each) > init}
    for split in ("tune", "held_out"):
        means = [d["mean"] for d in out["documents"].values() if d["split"] == split]
        if means:
            out["splits"][split] = sum(means) / len(means)
    kept = [e[key]["gain_kept"] for r in reports.values() if "trained" in r.get("composition", {})
            for e in r["composition"]["trained"]["documents"].values() for key in e
            if key not in ("single_gain", "none", "single") and not key.endswith("concatenated")]
    if kept:
        out["composition_worst_kept"] = None if None in kept else min(kept)
    print("\n| document | split | recovered by seed | mean | worst | init | above init every seed |")
    print("|---|---|---|---|---|---|---|")
    for name, d in out["documents"].items():
        print(f"| {name} | {d['split']} | {' / '.join(f'{v:.2f}' for v in d['recovered'])} | {d['mean']:.2f} | "
              f"{d['worst']:.2f} | {d['init']:.2f} | {'yes' if d['above_init_every_seed'] else 'no'} |")
    for split, mean in out["splits"].items():
        print(f"| **{split} mean over seeds** | | | **{mean:.2f}** | | | |")
    if kept:
        worst = out["composition_worst_kept"]
        print("composition (default), worst share of a single-cartridge gain kept over seeds: "
              + ("n/a (no single gain)" if worst is None else f"{worst:.2f}"))
    return out


def main() -> int:
    parser = suite_arguments(__doc__, DOCS_DIR, ALL_DOCS, DEFAULT_TUNE)
    parser.add_argument("--baselines-only", action="store_true", help="no training: none, in_context, truncated, init")
    parser.add_argument("--compose", type=parser.names_list, metavar="A,B", help="compose the cartridges of two documents")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: tiny synthesis and training ({QUICK_CONFIG}), {QUICK_QUESTIONS} questions")
    parser.add_argument("--max-questions", type=int, default=0, help="N questions per document, taken in turn from each kind (0: all)")
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], metavar="S,S,...",
                        help="train and evaluate under each of these seeds and report them together (the "
                        "quality figures vary much between seeds at this model size); default: the config's seed")
    args = parser.parse_args()
    if args.compose and len(args.compose) != 2:
        parser.error("--compose takes two documents: A,B")
    if args.quick and not args.max_questions:
        args.max_questions = QUICK_QUESTIONS

    model = suite_model(args)
    if args.check_docs:
        return check_docs(model, args.docs)
    config = TrainConfig(**{**(QUICK_CONFIG if args.quick else {}), **parse_overrides(args.overrides)})
    names = list(dict.fromkeys([*args.docs, *(args.compose or [])]))
    docs = {n: load_document(n) for n in names}
    t0 = time.perf_counter()
    seeds = args.seeds or [config.seed]
    reports = {}
    for seed in seeds:
        if len(seeds) > 1:
            print(f"== seed {seed}", file=sys.stderr)
        reports[seed] = run_suite(model, docs, config.replace(seed=seed), args)
    if len(seeds) == 1:
        report = reports[seeds[0]]
    else:
        report = {"seeds": {str(s): r for s, r in reports.items()}, "across_seeds": across_seeds(reports)}
    report["wall_s"] = time.perf_counter() - t0

    if len(seeds) == 1:
        summary = {k: v for k, v in report.items() if k != "documents"}
        summary["documents"] = {n: {k: v for k, v in d.items() if k not in ("per_question", "train_stats")}
                                for n, d in report["documents"].items()}
        print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
