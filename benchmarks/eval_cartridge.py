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

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cartridges
import cartridges_core
from cartridges.jobs.config import field_types
from cartridges.cartridge import Cartridge
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.selfstudy.prompts import SYSTEM_PROMPT
from cartridges.models.tokenizer import common_prefix_len
from cartridges.training import init_params

DOCS_DIR = Path(__file__).resolve().parent / "eval_docs"
ALL_DOCS = ("handbook", "report", "narrative", "manual")
DEFAULT_TUNE = ("handbook", "report")
KINDS = ("literal", "paraphrase", "indirect", "yes_no", "computed")
CONDITIONS = ("none", "in_context", "truncated", "init", "cartridge")

# --quick: enough to run every stage end to end in a few minutes on one core, not to learn.
QUICK_CONFIG = dict(num_samples=16, synthesis_batch_size=8, chunk_tokens=256,
                    max_question_tokens=32, max_answer_tokens=48, epochs=1, batch_size=4)
QUICK_QUESTIONS = 10
# TrainConfig fields that change training but not synthesis.
TRAINING_ONLY_FIELDS = {"lr", "anchor", "epochs", "batch_size", "grad_accum", "cosine", "warmup", "layer_scaled_lr",
                        "channel_scaled_lr", "loss_weighting", "checkpoint_every", "companion_every", "num_frozen",
                        "init", "num_tokens"}


# -- documents ------------------------------------------------------------------------------

@dataclass
class Question:
    question: str
    answer: str  # short gold string: scored as the reply's first tokens, searched in the reply
    kind: str
    aliases: tuple[str, ...] = ()  # other spellings the contains-match accepts ("1,150" / "1150")


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
        if q.kind not in KINDS:
            raise ValueError(f"{name}: unknown kind {q.kind!r} for {q.question!r}")
        if q.kind == "yes_no" and q.answer not in ("Yes", "No"):
            raise ValueError(f"{name}: a yes_no answer is 'Yes' or 'No', got {q.answer!r}")
        if q.kind == "literal" and not any(normalize(a) in normalize(text) for a in (q.answer, *q.aliases)):
            raise ValueError(f"{name}: the literal answer {q.answer!r} is not in the document")
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


# -- matching -------------------------------------------------------------------------------

def normalize(text: str) -> str:
    """Lower case, single spaces, one kind of apostrophe and dash."""
    text = text.replace("\u2019", "'").replace("\u2013", "-").replace("\u2014", "-")
    return " ".join(text.lower().split())


def contains_match(reply: str, q: Question) -> bool:
    """Yes/no: the reply's first 'yes' or 'no' is the gold one. Otherwise: the gold string (or an
    alias) occurs in the reply, a number not as part of a longer number ('4' is not in '40')."""
    text = normalize(reply)
    if q.kind == "yes_no":
        first = re.search(r"\b(yes|no)\b", text)
        return first is not None and first.group(1) == q.answer.lower()
    for gold in (q.answer, *q.aliases):
        gold = normalize(gold)
        for m in re.finditer(re.escape(gold), text):
            s, e = m.span()
            if (s > 0 and gold[0].isdigit() and text[s - 1].isdigit()) or (
                    e < len(text) and gold[-1].isdigit() and text[e].isdigit()):
                continue
            return True
    return False


# -- conditions -----------------------------------------------------------------------------

@dataclass
class Condition:
    """What stands before the question: a system prompt (the document, whole or cut) whose KV is
    computed once and shared, and/or cartridges (KV prefixes) in front."""
    system: str | None = None
    prefixes: tuple[Any, ...] = ()
    composition: str = "mixture"  # of two or more cartridges, as the library and server default


def chat_prompts(model, questions: list[Question], system: str | None) -> list[list[int]]:
    messages = [[{"role": "user", "content": q.question}] for q in questions]
    if system is not None:
        messages = [[{"role": "system", "content": system}, *m] for m in messages]
    return [list(model.tokenizer.encode_chat(m, add_generation_prompt=True)) for m in messages]


def system_len(model, system: str, prompts: list[list[int]]) -> int:
    """Tokens every prompt shares as its system part: the template up to the user's text (two
    different user texts tell where), or the prompts' common start for a template that differs."""
    probes = chat_prompts(model, [Question("A", "", "literal"), Question("B", "", "literal")], system)
    shared = common_prefix_len(probes)
    if any(p[:shared] != probes[0][:shared] for p in prompts):
        shared = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
    return shared


def context_prompts(model, questions: list[Question], cond: Condition) -> tuple[list[list[int]], list[Any], int]:
    """Token ids of each question's prompt after the shared context, the KV prefixes in front of
    them, and the number of KV tokens of the context (what it costs in memory per request)."""
    prompts = chat_prompts(model, questions, cond.system)
    prefixes = list(cond.prefixes)
    kv_tokens = sum(p.num_tokens for p in prefixes)
    if cond.system is not None:
        # The system prompt is the same for every question: its KV is computed once, as a
        # prefix (the same numbers as prefilling it with each question, a fraction of the time).
        shared = system_len(model, cond.system, prompts)
        prefixes.append(model.core.prefix_from_tokens(torch.tensor(prompts[0][:shared], dtype=torch.long)))
        prompts = [p[shared:] for p in prompts]
        kv_tokens += shared
    return prompts, prefixes, kv_tokens


def system_kv_tokens(model, system: str) -> int:
    """KV tokens of a system prompt as context_prompts counts them."""
    return system_len(model, system, [])


def truncated_document(model, text: str, kv_tokens: int) -> tuple[str, int]:
    """The longest start of the document whose system prompt holds at most `kv_tokens` KV tokens,
    and the number of document tokens it keeps."""
    tok = model.tokenizer
    ids = tok.encode(text)
    overhead = system_kv_tokens(model, SYSTEM_PROMPT.format(chunk=""))
    n = max(1, kv_tokens - overhead)
    while n > 1:
        cut = tok.decode(ids[:n])
        if system_kv_tokens(model, SYSTEM_PROMPT.format(chunk=cut)) <= kv_tokens:
            return cut, n
        n -= 1
    return tok.decode(ids[:1]), 1


def token_logprobs(model, tokens: list[int], prefixes: list[Any]) -> torch.Tensor:
    """[T - 1]: log p(tokens[t] | prefixes, tokens[<t]) for t >= 1, the prefixes concatenated."""
    with torch.no_grad():
        logits = model.core.forward(torch.tensor([tokens]), prefixes=[prefixes] if prefixes else None)[0]
    logp = torch.log_softmax(logits[:-1].float(), -1)
    return logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def bayes_mixture(per_cartridge: torch.Tensor, weigh_from: int = 0) -> torch.Tensor:
    """[C, T] log-probabilities of each token under each cartridge (row t predicts token t + 1)
    -> [T] under the mixture whose weights are each cartridge's likelihood of the tokens before,
    from token `weigh_from` on (uniform prior): what the engine samples from when it composes
    cartridges by mixture."""
    per_cartridge = per_cartridge.double()
    counted = per_cartridge.clone()
    counted[:, :max(weigh_from - 1, 0)] = 0  # rows that predict tokens before weigh_from
    before = torch.cat([torch.zeros(per_cartridge.shape[0], 1, dtype=torch.float64),
                        counted.cumsum(1)[:, :-1]], 1)
    return torch.logsumexp(before + per_cartridge, 0) - torch.logsumexp(before, 0)


def answer_logliks(model, prompts: list[list[int]], answers: list[list[int]], prefixes: list[Any],
                   composition: str = "concatenate") -> list[float]:
    """Sum of log p(answer tokens | prefixes, prompt) for each pair; several prefixes composed
    by `composition`."""
    out = []
    for prompt, answer in zip(prompts, answers):
        tokens, at = prompt + answer, slice(len(prompt) - 1, None)  # the positions that predict the answer
        if composition == "mixture" and len(prefixes) > 1:
            logp = bayes_mixture(torch.stack([token_logprobs(model, tokens, [p]) for p in prefixes]),
                                 model.engine.template_opening(prompt))  # as the engine weighs
        else:
            logp = token_logprobs(model, tokens, prefixes)
        out.append(float(logp[at].sum()))
    return out


def evaluate(model, questions: list[Question], cond: Condition, max_reply: int) -> dict:
    """Log-likelihood of the gold answers and contains-match of greedy replies, overall and by kind."""
    t0 = time.perf_counter()
    prompts, prefixes, kv_tokens = context_prompts(model, questions, cond)
    answers = [model.tokenizer.encode(q.answer) for q in questions]
    loglik = answer_logliks(model, prompts, answers, prefixes, cond.composition)
    replies = model.generate(prompts, max_new_tokens=max_reply, prefixes=prefixes or None,
                             composition=cond.composition)
    matches = [contains_match(r.text, q) for q, r in zip(questions, replies)]

    def summary(idx: list[int]) -> dict:
        return {
            "n": len(idx),
            "loglik_per_token": sum(loglik[i] for i in idx) / sum(len(answers[i]) for i in idx),
            "loglik_sum": sum(loglik[i] for i in idx) / len(idx),
            "match": sum(matches[i] for i in idx) / len(idx),
        }

    everything = list(range(len(questions)))
    return {
        **summary(everything),
        "by_kind": {k: summary([i for i in everything if questions[i].kind == k])
                    for k in KINDS if any(q.kind == k for q in questions)},
        "kv_tokens": kv_tokens,
        "eval_s": time.perf_counter() - t0,
        "per_question": [{"loglik": ll, "reply": r.text, "match": m}
                         for ll, r, m in zip(loglik, replies, matches)],
    }


def recovered(value: float, none: float, full: float) -> float:
    return (value - none) / (full - none) if full != none else math.nan


def add_recovered(conds: dict[str, dict]) -> dict:
    """(condition - none) / (in_context - none), overall and by kind, for every other condition."""
    none, full = conds["none"], conds["in_context"]
    out = {}
    for name, c in conds.items():
        if name in ("none", "in_context"):
            continue
        out[name] = {
            "all": recovered(c["loglik_per_token"], none["loglik_per_token"], full["loglik_per_token"]),
            "by_kind": {k: recovered(v["loglik_per_token"], none["by_kind"][k]["loglik_per_token"],
                                     full["by_kind"][k]["loglik_per_token"]) for k, v in c["by_kind"].items()},
        }
    return out


# -- cartridges -----------------------------------------------------------------------------

def kv_bytes_per_token(model) -> int:
    c = model.core.config
    element = torch.empty((), dtype=getattr(torch, model.dtype)).element_size()
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def cartridge_key(model, doc: Document, config: TrainConfig) -> str:
    blob = json.dumps([model.fingerprint, doc.text, config.to_dict()], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def for_document(model, doc: Document, config: TrainConfig) -> TrainConfig:
    """`config` with what it leaves to the document (cartridge length, conversations) decided as
    training decides it, so that the baselines and the caches see the same sizes."""
    return config.for_corpus(len(Corpus.from_texts(model.tokenizer, [doc.text])))


def get_cartridge(model, doc: Document, config: TrainConfig, directory: Path) -> tuple[Cartridge, dict]:
    """The trained cartridge of `doc` under `config`, from `directory` when it was trained before."""
    config = for_document(model, doc, config)
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / f"{doc.name}-{cartridge_key(model, doc, config)}"
    path, stats_path = base.with_suffix(".safetensors"), base.with_suffix(".json")
    if path.exists() and stats_path.exists():
        print(f"[{doc.name}] cartridge from {path}", file=sys.stderr)
        return Cartridge.load(path, model), {**json.loads(stats_path.read_text()), "cached": True}
    conversations = config.num_samples
    checkpoint = base.with_suffix(".ckpt")
    # Synthesized data is kept apart, under a key of what synthesis depends on: settings that
    # change training only (lr, epochs, ...) reuse it.
    synthesis = {k: v for k, v in config.to_dict().items() if k not in TRAINING_ONLY_FIELDS}
    data_key = hashlib.sha256(json.dumps([model.fingerprint, doc.text, synthesis], sort_keys=True).encode()).hexdigest()[:12]
    data_path = directory / f"{doc.name}-data-{data_key}.pt"
    data = held_out = None
    if data_path.exists():
        saved = torch.load(data_path, weights_only=True)
        data = cartridges_core.TrainingData(**saved["data"])
        held_out = cartridges_core.TrainingData(**saved["held_out"]) if saved["held_out"] else None
        print(f"[{doc.name}] training on the synthesized data of {data_path}", file=sys.stderr)
    else:
        print(f"[{doc.name}] synthesis ({conversations} conversations) and training", file=sys.stderr)
    cart = cartridges.train(model, [doc.text], config, progress=True, checkpoint=checkpoint, resume=True,
                            data=data, held_out=held_out)
    if data is None:
        def fields_of(d):
            return {n: getattr(d, n) for n in ("tokens", "lengths", "target_mask", "topk_ids", "topk_logprobs")}

        held = cart.stats["held_out"]
        torch.save({"data": fields_of(cart.stats["data"]), "held_out": fields_of(held) if held is not None else None,
                    "synthesis_s": cart.stats["synthesis_s"]}, data_path)
    else:
        cart.stats["synthesis_s"] = torch.load(data_path, weights_only=True).get("synthesis_s")
    cart.save(path)
    stats = {k: v for k, v in cart.stats.items() if k not in ("data", "held_out")}  # tensors
    losses = stats.pop("losses")
    stats.update(loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                 losses=losses, cached=False)
    stats_path.write_text(json.dumps(stats, indent=1))
    for leftover in directory.glob(f"{base.name}.ckpt*"):  # training is done: its checkpoints go
        leftover.unlink()
    return cart, stats


def baseline_cached(model, doc: Document, questions: list[Question], config: TrainConfig, name: str, args,
                    run) -> dict:
    """`run()`, the figures of condition `name`, kept in --cartridge-dir for the conditions that
    do not depend on training (all but "cartridge"): they depend on the model, the document,
    the questions, the cartridge's size and initialization, and the reply length only."""
    if name == "cartridge":
        return run()
    blob = json.dumps([model.fingerprint, doc.text, [q.__dict__ for q in questions], name, config.num_tokens,
                       config.num_frozen, config.init, args.max_reply], sort_keys=True).encode()
    path = args.cartridge_dir / f"{doc.name}-{name}-{hashlib.sha256(blob).hexdigest()[:12]}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = run()
    args.cartridge_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def init_cartridge(model, doc: Document, config: TrainConfig) -> Cartridge:
    config = for_document(model, doc, config)
    params = init_params(model, Corpus.from_texts(model.tokenizer, [doc.text]), config)
    return Cartridge.from_params(params, model.fingerprint, config.to_dict())


# -- the suite ------------------------------------------------------------------------------

def evaluate_document(model, doc: Document, config: TrainConfig, args, split: str,
                      memo: dict) -> tuple[dict, Cartridge | None]:
    questions = select_questions(doc.questions, args.max_questions)
    per_token = kv_bytes_per_token(model)
    config = for_document(model, doc, config)
    init = init_cartridge(model, doc, config)
    cut, cut_tokens = truncated_document(model, doc.text, init.num_tokens)
    conditions = {
        "none": Condition(),
        "in_context": Condition(system=SYSTEM_PROMPT.format(chunk=doc.text)),
        "truncated": Condition(system=SYSTEM_PROMPT.format(chunk=cut)),
        "init": Condition(prefixes=(init.prefix(model),)),
    }
    cart, train_stats = None, {}
    if not args.baselines_only:
        cart, train_stats = get_cartridge(model, doc, config, args.cartridge_dir)
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
        "recovered": add_recovered(results),
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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    types = field_types()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"--set takes FIELD=VALUE with a TrainConfig field ({', '.join(types)}); got {item!r}")
        kind, nullable = types[key]
        if nullable and value.lower() in ("none", "null"):
            out[key] = None
        elif kind is bool:
            out[key] = value.lower() in ("1", "true", "yes", "on")
        else:
            out[key] = kind(value)
    return out


def names_list(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    for n in names:
        if not (DOCS_DIR / f"{n}.md").exists():
            raise argparse.ArgumentTypeError(f"no document {n!r} in {DOCS_DIR}")
    return names


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
        "model": model.name, "threads": args.threads, "quick": args.quick, "baselines_only": args.baselines_only,
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
                carts[name] = get_cartridge(model, docs[name], config, args.cartridge_dir)[0]
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=names_list, default=list(ALL_DOCS), help="documents to evaluate (comma-separated)")
    parser.add_argument("--tune", type=names_list, default=list(DEFAULT_TUNE),
                        help="the tuning subset (choose settings on these); the others are reported as held out")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="a TrainConfig field for training (repeatable), e.g. --set num_samples=64")
    parser.add_argument("--baselines-only", action="store_true", help="no training: none, in_context, truncated, init")
    parser.add_argument("--compose", type=names_list, metavar="A,B", help="compose the cartridges of two documents")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: tiny synthesis and training ({QUICK_CONFIG}), {QUICK_QUESTIONS} questions")
    parser.add_argument("--cartridge-dir", type=Path, default=Path("benchmarks/.cartridges"),
                        help="where trained cartridges are kept and reused (default: %(default)s)")
    parser.add_argument("--max-questions", type=int, default=0, help="N questions per document, taken in turn from each kind (0: all)")
    parser.add_argument("--max-reply", type=int, default=48, help="greedy reply tokens for the contains-match")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (default: all cores)")
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], metavar="S,S,...",
                        help="train and evaluate under each of these seeds and report them together (the "
                        "quality figures vary much between seeds at this model size); default: the config's seed")
    parser.add_argument("--out", metavar="PATH", help="write every figure (and every reply) as JSON here")
    parser.add_argument("--check-docs", action="store_true",
                        help="only check the documents (token counts, kinds, literal answers in the text) and exit")
    args = parser.parse_args()
    if args.compose and len(args.compose) != 2:
        parser.error("--compose takes two documents: A,B")
    if args.quick and not args.max_questions:
        args.max_questions = QUICK_QUESTIONS

    torch.set_num_threads(args.threads)  # before the engine starts: its compute thread follows it
    model = cartridges.load_model()
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
        reports[seed] = run_suite(model, docs, dataclasses.replace(config, seed=seed), args)
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
