"""Long-corpus evaluation suite: does a cartridge remember every part of a corpus longer than
the model's context, and does it beat what a user would build instead?

Documents (benchmarks/eval_docs/long/): invented corpora of 12K-60K tokens in sections headed
"## N. Title", with 5+ questions per section (literal, numeric, paraphrase, yes/no) and
multi-hop questions that join two distant sections; each question names its section(s).
Conditions, scored on the same questions by the scorer of eval_cartridge.py (evaluation.py):
  none                 no context
  truncation           the corpus' beginning, as much of it as fits in the context
  retrieval            BM25 (bm25s) over ~300-token chunks, the top 4 in context
  oracle               the question's own section(s) in context: the upper bound
  init                 the cartridge's untrained initialization
  cartridge            the cartridge trained by self-study (TrainConfig's defaults, or --set)
  cartridge+retrieval  the cartridge in front and the retrieved chunks in the prompt
  parts                a cartridge per part of the corpus (`cartridges.parts`: runs of whole
                       sections of about two contexts at most, each after the corpus' opening),
                       trained by the same config and composed by mixture, as `cartridges train`
                       makes them past four contexts and a chat request on their file is answered
  parts-route          the same parts composed by route: the part the mixture weighs most before
                       the reply decodes it alone (chat's `composition: "route"`)
  parts-search         the same parts, the one BM25 over their own text finds for the question
                       (`cartridges.parts.PartSearch`: the best chunk's part; parts that tie,
                       by mixture) alone in front; chat's `composition: "search"`
  parts-search+retrieval  that part in front and the retrieved chunks in the prompt
"recovered" = (condition - none) / (oracle - none) on log p(gold) per token: overall, per
section and per question kind, next to the exact-answer rate (the gold in a greedy reply).
A bar chart per document (one group of bars per section) goes to --plot-dir (docs/images for a
run of the defaults with every condition, or --from-json; CARTRIDGE_DIR/plots otherwise).

    python benchmarks/eval_long.py --baselines-only              # no training (minutes)
    python benchmarks/eval_long.py --docs atlas --out atlas.json # trains the atlas' cartridge
    python benchmarks/eval_long.py --check-docs                  # the documents' rules
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cartridges.cartridge import Cartridge
from cartridges.parts import DEFAULT_PART_CONTEXTS, MIN_PART_TOKENS, PartSearch, corpus_parts
from cartridges.retrieval import CHUNK_TOKENS as RETRIEVAL_CHUNK_TOKENS, TOP_K as RETRIEVAL_TOP_K, Retriever, passages_prompt
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.training import init_params
from evaluation import (Condition, Question, add_recovered, cached_result, check_question, document_prompt, evaluate,
                        evaluate_each, for_text, get_cartridge, kv_bytes_per_token, parse_overrides, recovered, suite_arguments,
                        suite_model, summary, truncated_document)

DOCS_DIR = Path(__file__).resolve().parent / "eval_docs" / "long"
ALL_DOCS = ("atlas", "chronicle", "rulebook", "almanac", "lighthouse", "university", "navigation")
DEFAULT_TUNE = ("atlas", "chronicle")  # the other documents are held out from every tuning decision
KINDS = ("literal", "numeric", "paraphrase", "yes_no", "multi_hop")
PARTS_CONDITIONS = ("parts", "parts-route", "parts-search", "parts-search+retrieval")
CONDITIONS = ("none", "truncation", "retrieval", "oracle", "init", "cartridge", "cartridge+retrieval", *PARTS_CONDITIONS)
DEFAULT_CONDITIONS = CONDITIONS[:-len(PARTS_CONDITIONS)]  # parts train a cartridge per part as well: asked for by name
PLOTTED = ("none", "truncation", "retrieval", "oracle", "cartridge", "cartridge+retrieval", "parts")
SECTION_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)


@dataclass
class LongDocument:
    name: str
    text: str
    sections: list[str]  # section n (from 1) is sections[n - 1], its heading included
    questions: list[Question]

    def section_text(self, numbers: tuple[int, ...]) -> str:
        return "\n\n".join(self.sections[n - 1] for n in sorted(numbers))


def split_sections(text: str) -> list[str]:
    """The "## N. Title" sections of a document, numbered 1, 2, ... in order."""
    starts = [m.start() for m in SECTION_HEADING.finditer(text)]
    numbers = [int(m.group(1)) for m in SECTION_HEADING.finditer(text)]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"sections must be numbered 1, 2, ... in order; found {numbers}")
    return [text[s:e].strip() for s, e in zip(starts, [*starts[1:], len(text)])]


def load_document(name: str, docs_dir: Path = DOCS_DIR) -> LongDocument:
    text = (docs_dir / f"{name}.md").read_text()
    sections = split_sections(text)
    questions = []
    for raw in json.loads((docs_dir / f"{name}.questions.json").read_text()):
        q = Question(raw["question"], raw["answer"], raw["kind"], tuple(raw.get("aliases", ())),
                     tuple(raw["sections"]))
        if not q.sections or any(not 1 <= s <= len(sections) for s in q.sections):
            raise ValueError(f"{name}: {q.question!r} names sections {q.sections} of {len(sections)}")
        if (q.kind == "multi_hop") != (len(q.sections) == 2):
            raise ValueError(f"{name}: a multi_hop question names two sections, any other one: {q.question!r}")
        check_question(name, q, "\n\n".join(sections[s - 1] for s in q.sections), KINDS)
        questions.append(q)
    return LongDocument(name, text, sections, questions)


def check_docs(model, names: list[str]) -> int:
    """The suite's rules: 12K-20K tokens (or 40K-60K), 5+ questions per section, every kind
    present, multi-hop questions joining sections at least a quarter of the document apart."""
    failures = 0
    for name in names:
        doc = load_document(name)
        tokens = len(model.tokenizer.encode(doc.text))
        per_section = [sum(s in q.sections and q.kind != "multi_hop" for q in doc.questions)
                       for s in range(1, len(doc.sections) + 1)]
        kinds = {k: sum(q.kind == k for q in doc.questions) for k in KINDS}
        far = all(abs(q.sections[0] - q.sections[1]) >= len(doc.sections) / 4
                  for q in doc.questions if q.kind == "multi_hop")
        ok = (12_000 <= tokens <= 20_000 or 40_000 <= tokens <= 60_000) and min(per_section) >= 5 \
            and all(kinds.values()) and far
        failures += not ok
        print(f"{name}: {tokens} tokens, {len(doc.sections)} sections, {len(doc.questions)} questions {kinds}, "
              f"{min(per_section)}-{max(per_section)} per section, multi-hop far apart: {far}: "
              f"{'ok' if ok else 'FAILS the rules'}")
    return 1 if failures else 0


# -- what a user would build instead --------------------------------------------------------

def retrieve(model, text: str, questions: list[Question], k: int = RETRIEVAL_TOP_K) -> list[list[str]]:
    """Per question, its top-k chunks of ~300 tokens by BM25, best first: the server's
    `retrieval` mode (cartridges.retrieval), which is also the baseline a user would build."""
    return Retriever.from_texts(model.tokenizer, [text]).search_many([q.question for q in questions], k)


def truncation_budget(model, questions: list[Question], max_reply: int) -> int:
    """KV tokens the corpus' beginning may take: the context less the longest question's prompt
    and the reply."""
    longest = max(len(model.tokenizer.encode_chat([{"role": "user", "content": q.question}],
                                                  add_generation_prompt=True)) for q in questions)
    return model.context_length - longest - max_reply


# -- the suite ------------------------------------------------------------------------------

def by_section(doc: LongDocument, questions: list[Question], result: dict) -> dict[int, dict]:
    """Per section asked about, the figures of its own questions (multi-hop ones count for both
    sections)."""
    sections = range(1, len(doc.sections) + 1)
    idx = {s: [i for i, q in enumerate(questions) if s in q.sections] for s in sections}
    return {s: summary(result["per_question"], rows) for s, rows in idx.items() if rows}


def recovered_table(results: dict[str, dict], sections: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """(condition - none) / (oracle - none) per token: overall, by kind and by section."""
    out = add_recovered(results, "oracle")
    for name, rec in out.items():
        rec["by_section"] = {s: recovered(v["loglik_per_token"], sections["none"][s]["loglik_per_token"],
                                          sections["oracle"][s]["loglik_per_token"])
                             for s, v in sections[name].items()}
    return out


def cached(model, doc: LongDocument, questions: list[Question], config: TrainConfig, name: str, args, run) -> dict:
    """`run()`, the figures of a condition that does not depend on training, kept in
    --cartridge-dir under a key of what it depends on: the model, the corpus, the questions,
    the reply length and, for init, the cartridge's length and initialization."""
    init = [config.num_tokens, config.num_frozen, config.init] if name == "init" else None
    key = [model.fingerprint, doc.text, [q.cache_key() for q in questions], name, init, args.max_reply,
           RETRIEVAL_CHUNK_TOKENS, RETRIEVAL_TOP_K]
    return cached_result(args.cartridge_dir, f"long-{doc.name}-{name}", key, run)


def evaluate_document(model, doc: LongDocument, config: TrainConfig, args, split: str) -> dict[str, Any]:
    questions = doc.questions[:args.max_questions] if args.max_questions else doc.questions
    requested, config = config, for_text(model, doc.text, config)  # each part decides its own
    corpus_tokens = len(Corpus.from_texts(model.tokenizer, [doc.text]))
    cut, cut_tokens = truncated_document(model, doc.text, truncation_budget(model, questions, args.max_reply))
    retrieved = retrieve(model, doc.text, questions)

    @functools.cache
    def initialization() -> Cartridge:  # only when asked for: a long corpus' compaction takes minutes
        return Cartridge.from_params(init_params(model, Corpus.from_texts(model.tokenizer, [doc.text]), config),
                                     model.fingerprint, config.to_dict())

    runs = {
        "none": lambda: evaluate(model, questions, Condition(), args.max_reply),
        "truncation": lambda: evaluate(model, questions, Condition(system=document_prompt(cut)), args.max_reply),
        "retrieval": lambda: evaluate_each(model, questions, [Condition(system=passages_prompt(r)) for r in retrieved],
                                           args.max_reply),
        "oracle": lambda: evaluate_each(
            model, questions, [Condition(system=document_prompt(doc.section_text(q.sections))) for q in questions],
            args.max_reply),
        "init": lambda: evaluate(model, questions, Condition(prefixes=(initialization().prefix(model),)),
                                 args.max_reply),
    }
    train_stats: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    if set(PARTS_CONDITIONS) & set(args.conditions) and not args.baselines_only:
        part_tokens = args.part_tokens or DEFAULT_PART_CONTEXTS * model.context_length
        texts = corpus_parts(model.tokenizer, doc.text, part_tokens)
        trained = [get_cartridge(model, f"{doc.name}-part{j}of{len(texts)}", text, requested, args.cartridge_dir)
                   for j, text in enumerate(texts, 1)]
        parts = {"tokens": [len(Corpus.from_texts(model.tokenizer, [t])) for t in texts],
                 "cartridge_tokens": [c.num_tokens for c, _ in trained],
                 "configs": [c.config for c, _ in trained],
                 **{stage: sum(s.get(stage) or 0 for _, s in trained) for stage in ("init_s", "synthesis_s", "training_s")},
                 "train_stats": [s for _, s in trained]}
        prefixes = tuple(c.prefix(model) for c, _ in trained)  # built once for every composition
        for name, composition in (("parts", "mixture"), ("parts-route", "route")):
            runs[name] = functools.partial(evaluate, model, questions,
                                           Condition(prefixes=prefixes, composition=composition), args.max_reply)
        found = PartSearch(model.tokenizer, texts).find_many([q.question for q in questions])
        holding = [{j for j, t in enumerate(texts) if section.splitlines()[0] in t} for section in doc.sections]
        parts["search_finds_section"] = sum(any(j in holding[s - 1] for j in js for s in q.sections)
                                            for js, q in zip(found, questions)) / len(questions)
        parts["search_parts_per_question"] = sum(len(js) or len(texts) for js in found) / len(questions)
        searched = [tuple(prefixes[j] for j in js) or prefixes for js in found]  # none found: every part
        runs["parts-search"] = functools.partial(evaluate_each, model, questions,
                                                 [Condition(prefixes=p) for p in searched], args.max_reply)
        runs["parts-search+retrieval"] = functools.partial(evaluate_each, model, questions, [
            Condition(system=passages_prompt(r), prefixes=p) for r, p in zip(retrieved, searched)], args.max_reply)
    if args.baselines_only:
        cart = initialization()
    elif not {"cartridge", "cartridge+retrieval"} & set(args.conditions):
        cart = None  # only the parts': the whole corpus' cartridge is not trained
    else:
        cart, train_stats = get_cartridge(model, doc.name, doc.text, config, args.cartridge_dir)
        prefix = cart.prefix(model)
        runs["cartridge"] = lambda: evaluate(model, questions, Condition(prefixes=(prefix,)), args.max_reply)
        runs["cartridge+retrieval"] = lambda: evaluate_each(
            model, questions, [Condition(system=passages_prompt(r), prefixes=(prefix,)) for r in retrieved],
            args.max_reply)
    results, sections = {}, {}
    for name, run in runs.items():
        if name not in args.conditions and name not in ("none", "oracle"):  # those two: what recovered needs
            continue
        results[name] = run() if name.startswith(("cartridge", "parts")) else cached(model, doc, questions, config, name, args, run)
        sections[name] = by_section(doc, questions, results[name])
        r = results[name]
        print(f"[{doc.name}] {name:19s} loglik/token {r['loglik_per_token']:7.3f}  match {r['match']:.3f}  "
              f"kv {r['kv_tokens']:7.0f} tokens  ({r['eval_s']:.0f} s)", file=sys.stderr)
    per_token = kv_bytes_per_token(model)
    return {
        "split": split,
        "corpus_tokens": corpus_tokens,
        "sections": len(doc.sections),
        "section_titles": [s.splitlines()[0][3:] for s in doc.sections],
        "questions": len(questions),
        "kinds": {k: sum(q.kind == k for q in questions) for k in KINDS},
        "truncation_document_tokens": cut_tokens,
        "truncation_reaches_section": max(s for s in range(1, len(doc.sections) + 1)
                                          if doc.sections[s - 1].splitlines()[0] in cut),
        "kv": {"corpus_bytes": corpus_tokens * per_token, "cartridge_tokens": cart.num_tokens,
               "cartridge_bytes": cart.nbytes, "ratio": corpus_tokens * per_token / cart.nbytes} if cart else None,
        "config": config.to_dict(),
        "init_s": train_stats.get("init_s"),
        "synthesis_s": train_stats.get("synthesis_s"),
        "training_s": train_stats.get("training_s"),
        "train_stats": train_stats,
        "parts": parts or None,
        "conditions": {name: {k: v for k, v in r.items() if k != "per_question"} for name, r in results.items()},
        "by_section": sections,
        "recovered": recovered_table(results, sections),
        "per_question": [{"question": q.question, "answer": q.answer, "kind": q.kind, "sections": q.sections,
                          **{name: r["per_question"][i] for name, r in results.items()}}
                         for i, q in enumerate(questions)],
    }


def joined(earlier: dict, later: dict) -> dict:
    """One document's figures from two runs on the same questions (--from-json), e.g. the
    baselines of one and the cartridge of another: the later run's conditions are added to the
    earlier's, or replace them. An untrained initialization of another config than the later
    run's is left out, since it would read as the later cartridge's."""
    if [q["question"] for q in earlier["per_question"]] != [q["question"] for q in later["per_question"]]:
        raise SystemExit("--from-json: two runs of a document on different questions cannot be joined")
    drop = set()
    if "init" in earlier["conditions"] and "init" not in later["conditions"] and any(
            earlier["config"].get(k) != later["config"].get(k) for k in ("init", "num_tokens", "num_frozen")):
        drop.add("init")
        print("--from-json: the earlier run's init is of another config than the later run's; left out",
              file=sys.stderr)
    out = {**earlier, **{k: v for k, v in later.items() if v is not None}}
    for key in ("conditions", "by_section", "recovered"):
        out[key] = {**{c: v for c, v in earlier[key].items() if c not in drop}, **later[key]}
    out["per_question"] = [{**{c: v for c, v in a.items() if c not in drop}, **b}
                           for a, b in zip(earlier["per_question"], later["per_question"])]
    return out


def match_not_yes_no(d: dict, condition: str) -> float:
    """The exact-answer rate of `condition` on the document's questions other than yes/no. The
    default model answers yes/no questions at about chance even with the question's own section
    in context, so exact answers there measure a lean toward "Yes" or "No" more than what was
    remembered; this rate is reported beside the whole."""
    rows = [q[condition]["match"] for q in d["per_question"] if q["kind"] != "yes_no" and condition in q]
    return sum(rows) / len(rows) if rows else float("nan")


def print_tables(name: str, d: dict) -> None:
    """Markdown tables of one document: overall, by kind, by section."""
    conds = list(d["conditions"])
    print(f"\n### {name} ({d['split']}): {d['corpus_tokens']} tokens, {d['sections']} sections, "
          f"{d['questions']} questions; truncation keeps {d['truncation_document_tokens']} tokens "
          f"(to section {d['truncation_reaches_section']})" + (
              f"; cartridge {d['kv']['cartridge_tokens']} tokens, {d['kv']['ratio']:.1f}x less KV than the corpus"
              if d.get("kv") else "") + (
              f"; parts of {', '.join(map(str, d['parts']['tokens']))} tokens, cartridges of "
              f"{', '.join(map(str, d['parts']['cartridge_tokens']))}" if d.get("parts") else "") + (
              f"; the parts searched for hold the question's section for "
              f"{d['parts']['search_finds_section']:.0%} of the questions"
              f" ({d['parts'].get('search_parts_per_question', 1):.2f} parts a question)"
              if (d.get("parts") or {}).get("search_finds_section") is not None else "") + "\n")
    print("| condition | log p/token | exact answers | exact, other than yes/no | recovered |\n|---|---|---|---|---|")
    for c in conds:
        r = d["conditions"][c]
        rec = d["recovered"].get(c, {}).get("all", 0.0 if c == "none" else 1.0)
        print(f"| {c} | {r['loglik_per_token']:.3f} | {r['match']:.2f} | {match_not_yes_no(d, c):.2f} | {rec:.2f} |")
    rec_conds = [c for c in conds if c in d["recovered"]]
    # The oracle's gain over no context in nats a token: a kind where it is small (numeric
    # questions) has ratios of small differences, which move a lot on little.
    print("\n| kind | n | oracle gain, nats/token | " + " | ".join(f"{c} rec / match" for c in rec_conds) + " |")
    print("|" + "---|" * (3 + len(rec_conds)))
    for k, n in d["kinds"].items():
        if n:
            gain = oracle_gain(d["conditions"]["none"]["by_kind"][k], d["conditions"]["oracle"]["by_kind"][k])
            print(f"| {k} | {n} | {gain:.2f} | " + " | ".join(
                f"{d['recovered'][c]['by_kind'][k]:.2f} / {d['conditions'][c]['by_kind'][k]['match']:.2f}"
                for c in rec_conds) + " |")
    # Sections too: the weakest sections are often those where the oracle gains least.
    print("\n| section | oracle gain, nats/token | " + " | ".join(f"{c} rec" for c in rec_conds) + " |")
    print("|" + "---|" * (2 + len(rec_conds)))
    for s in d["by_section"]["none"]:
        gain = oracle_gain(d["by_section"]["none"][s], d["by_section"]["oracle"][s])
        print(f"| {s} | {gain:.2f} | " + " | ".join(f"{d['recovered'][c]['by_section'][s]:.2f}" for c in rec_conds) + " |")


def oracle_gain(none: dict, oracle: dict) -> float:
    """The oracle's gain over no context in nats a token, on the same questions."""
    return oracle["loglik_per_token"] - none["loglik_per_token"]


def print_summary(report: dict) -> None:
    """One row per document: recovered and exact-answer rate of every condition, as
    benchmarks/README.md records them."""
    docs = report["documents"]
    conds = [c for c in CONDITIONS if any(c in d["conditions"] for d in docs.values())]
    print("\n| document | split | tokens | questions | " + " | ".join(conds) + " |")
    print("|" + "---|" * (4 + len(conds)))
    for name, d in docs.items():
        cells = []
        for c in conds:
            if c not in d["conditions"]:
                cells.append("")
                continue
            rec = d["recovered"].get(c, {}).get("all", 0.0 if c == "none" else 1.0)
            cells.append(f"{rec:.2f} / {d['conditions'][c]['match']:.2f}")
        print(f"| {name} | {d['split']} | {d['corpus_tokens']} | {d['questions']} | " + " | ".join(cells) + " |")
    print("(recovered log p gain over no context, as a share of the oracle's / exact-answer rate)")


def plot(name: str, d: dict, directory: Path) -> Path:
    """Bars per section: log p(gold) per token (above) and the exact-answer rate (below)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = [c for c in PLOTTED if c in d["conditions"]]
    sections = list(d["by_section"]["none"])
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(sections) * len(conds) / 3), 7), sharex=True)
    width = 0.8 / len(conds)
    for j, c in enumerate(conds):
        xs = [i + (j - (len(conds) - 1) / 2) * width for i in range(len(sections))]
        axes[0].bar(xs, [d["by_section"][c][s]["loglik_per_token"] for s in sections], width, label=c)
        axes[1].bar(xs, [d["by_section"][c][s]["match"] for s in sections], width, label=c)
    reach = d["truncation_reaches_section"]
    for ax in axes:  # where the corpus' beginning that fits in the context ends
        ax.axvline(sum(s <= reach for s in sections) - 0.5, color="grey", linestyle="--", linewidth=1)
    axes[0].set_ylabel("log p(gold) per token")
    axes[1].set_ylabel("exact answers")
    axes[1].set_xticks(range(len(sections)), [str(s) for s in sections])
    axes[1].set_xlabel(f"section (dashed: the end of what truncation keeps, in section {reach})")
    axes[0].set_title(f"{name}: {d['corpus_tokens']} tokens, {d['questions']} questions ({d['split']})", pad=28)
    axes[0].legend(ncol=len(conds), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"eval_long_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = suite_arguments(__doc__, DOCS_DIR, ALL_DOCS, DEFAULT_TUNE)
    parser.add_argument("--baselines-only", action="store_true",
                        help="no training: none, truncation, retrieval, oracle, init")
    parser.add_argument("--max-questions", type=int, default=0, help="the first N questions per document (0: all)")
    parser.add_argument("--conditions", type=lambda v: [c.strip() for c in v.split(",")], default=list(DEFAULT_CONDITIONS),
                        metavar="A,B,...", help=f"the conditions to run, of {', '.join(CONDITIONS)} (default: all but "
                        "the parts'; none and oracle always run)")
    parser.add_argument("--part-tokens", type=int, default=0, metavar="N",
                        help="the parts' conditions cut the corpus into parts of about N tokens (default: "
                        f"{DEFAULT_PART_CONTEXTS} of the model's contexts, as `cartridges train` does)")
    parser.add_argument("--plot-dir", type=Path, default=None,
                        help="where the bar charts go (default: docs/images for a run of the defaults with every "
                        "condition and question, or --from-json; CARTRIDGE_DIR/plots for any other run, so that it "
                        "does not overwrite the charts the docs show)")
    parser.add_argument("--from-json", nargs="+", type=Path, metavar="JSON",
                        help="no evaluation: the tables and charts of earlier runs' --out files, together (runs of "
                        "one document are joined: the later one's conditions added to the earlier one's)")
    args = parser.parse_args()
    unknown = set(args.conditions) - set(CONDITIONS)
    if unknown:
        parser.error(f"unknown conditions {sorted(unknown)}; choose from {', '.join(CONDITIONS)}")
    if args.part_tokens and args.part_tokens < MIN_PART_TOKENS:
        parser.error(f"--part-tokens must be at least {MIN_PART_TOKENS}, not {args.part_tokens}")
    trained = sorted({"cartridge", "cartridge+retrieval", *PARTS_CONDITIONS} & set(args.conditions))
    if args.baselines_only and set(args.conditions) != set(DEFAULT_CONDITIONS) and trained:
        parser.error(f"--baselines-only trains nothing, and {', '.join(trained)} need training: leave out one or the other")

    if args.plot_dir is None:
        full_run = (not args.overrides and not args.baselines_only and set(args.conditions) == set(DEFAULT_CONDITIONS)
                    and not args.max_questions)
        args.plot_dir = Path("docs/images") if args.from_json or full_run else args.cartridge_dir / "plots"
    if args.from_json:
        report = {"documents": {}}
        for path in args.from_json:
            for name, d in json.loads(path.read_text())["documents"].items():
                # JSON keeps section numbers as strings
                d["by_section"] = {c: {int(k): v for k, v in secs.items()} for c, secs in d["by_section"].items()}
                for rec in d["recovered"].values():
                    rec["by_section"] = {int(k): v for k, v in rec["by_section"].items()}
                known = report["documents"].get(name)
                report["documents"][name] = d if known is None else joined(known, d)
        for name, d in report["documents"].items():
            print_tables(name, d)
            print(f"plot: {plot(name, d, args.plot_dir)}", file=sys.stderr)
        print_summary(report)
        return 0
    model = suite_model(args)
    if args.check_docs:
        return check_docs(model, args.docs)
    config = TrainConfig(**parse_overrides(args.overrides))
    t0 = time.perf_counter()
    report: dict[str, Any] = {"model": model.name, "device": args.device, "threads": args.threads,
                              "baselines_only": args.baselines_only, "tune": args.tune, "documents": {}}
    for name in args.docs:
        split = "tune" if name in args.tune else "held_out"
        report["documents"][name] = d = evaluate_document(model, load_document(name), config, args, split)
        print_tables(name, d)
        print(f"plot: {plot(name, d, args.plot_dir)}", file=sys.stderr)
        if args.out:  # after every document: a long run keeps what it has
            Path(args.out).write_text(json.dumps({**report, "wall_s": time.perf_counter() - t0}, indent=1))
    print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
