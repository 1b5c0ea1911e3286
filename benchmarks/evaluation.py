"""The scorer both evaluation suites share: eval_cartridge.py (documents that fit in the
model's context) and eval_long.py (corpora beyond it).

A question has a short gold answer. Before it stands a *condition*: a system prompt (a document,
whole, cut or retrieved) and/or cartridges (KV prefixes). Per question, two figures:
  - the gold answer's log-likelihood as the start of the reply (summed over its tokens;
    reported per token over a set of questions);
  - whether a greedy reply contains the gold answer or one of its aliases (case-, space- and
    unit-lenient: "40 m³" is answered by "40"; a number never as part of a longer one).
Trained cartridges are kept on disk under a key of (model, document, config) and reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import torch

import cartridges
import cartridges_core
from cartridges.cartridge import Cartridge, native_model
from cartridges.models.tokenizer import common_prefix_len
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.selfstudy.config import describe, field_aliases
from cartridges.selfstudy.prompts import SYSTEM_PROMPT
from cartridges.training import decided_config

# TrainConfig fields that change training but not synthesis.
TRAINING_ONLY_FIELDS = {"learning_rate", "anchor", "epochs", "batch_size", "grad_accum", "cosine", "warmup", "layer_scaled_lr",
                        "channel_scaled_lr", "loss_weighting", "checkpoint_every", "companion_every", "num_frozen",
                        "init", "num_tokens", "training_dtype"}

# TrainConfig fields added after cartridges were cached, with the value that trains as before
# they existed: a config at that value leaves them out of its cache keys, so that adding a
# knob does not orphan every cached cartridge and its synthesized data.
FIELDS_ADDED_AS = {"passages_fraction": 0.0, "verify_targets": "teacher", "verify_style": "judge"}


def keyed_fields(config: TrainConfig) -> dict[str, Any]:
    """The config's fields that name its cached cartridge and data (FIELDS_ADDED_AS)."""
    return {k: v for k, v in config.to_dict().items() if k not in FIELDS_ADDED_AS or FIELDS_ADDED_AS[k] != v}


@dataclass
class Question:
    question: str
    answer: str  # short gold string: scored as the reply's first tokens, searched in the reply
    kind: str
    aliases: tuple[str, ...] = ()  # other spellings the contains-match accepts ("1,150" / "1150")
    sections: tuple[int, ...] = ()  # long documents: the section(s) that answer it, from 1

    def cache_key(self) -> dict[str, Any]:
        key = {"question": self.question, "answer": self.answer, "kind": self.kind, "aliases": self.aliases}
        return {**key, "sections": self.sections} if self.sections else key


def check_question(doc: str, q: Question, text: str, kinds: tuple[str, ...]) -> None:
    """A question's kind is known, a yes/no answer is Yes or No, a literal answer is in `text`."""
    if q.kind not in kinds:
        raise ValueError(f"{doc}: unknown kind {q.kind!r} for {q.question!r}")
    if q.kind == "yes_no" and q.answer not in ("Yes", "No"):
        raise ValueError(f"{doc}: a yes_no answer is 'Yes' or 'No', got {q.answer!r}")
    if q.kind == "literal" and not any(normalize(a) in normalize(text) for a in (q.answer, *q.aliases)):
        raise ValueError(f"{doc}: the literal answer {q.answer!r} is not in the document")


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
    """What stands before the question: a system prompt (the document, whole, cut or retrieved)
    and/or cartridges (KV prefixes) in front."""
    system: str | None = None
    prefixes: tuple[Any, ...] = ()
    composition: str = "mixture"  # of two or more cartridges, as the library and server default; or "route"


def document_prompt(text: str) -> str:
    """The system prompt that puts `text` in context, as self-study's teacher reads it."""
    return SYSTEM_PROMPT.format(chunk=text)


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
        shared = system_len(model, cond.system, prompts)
        kv_tokens += shared
        if not prefixes:
            # The system prompt is the same for every question: its KV is computed once, as a
            # prefix (the same numbers as prefilling it with each question, a fraction of the
            # time). Behind cartridges it stays in the prompt, where it attends to them.
            prefixes.append(model.native.prefix_from_tokens(torch.tensor(prompts[0][:shared], dtype=torch.long)))
            prompts = [p[shared:] for p in prompts]
    return prompts, prefixes, kv_tokens


def system_kv_tokens(model, system: str) -> int:
    """KV tokens of a system prompt as context_prompts counts them."""
    return system_len(model, system, [])


def truncated_document(model, text: str, kv_tokens: int) -> tuple[str, int]:
    """The longest start of the document whose system prompt holds at most `kv_tokens` KV tokens,
    and the number of document tokens it keeps."""
    tok = model.tokenizer
    ids = tok.encode(text)
    overhead = system_kv_tokens(model, document_prompt(""))
    n = min(len(ids), max(1, kv_tokens - overhead))
    while n > 1:
        cut = tok.decode(ids[:n])
        if system_kv_tokens(model, document_prompt(cut)) <= kv_tokens:
            return cut, n
        n -= 1
    return tok.decode(ids[:1]), 1


# -- scoring --------------------------------------------------------------------------------

def token_logprobs(model, tokens: list[int], prefixes: list[Any]) -> torch.Tensor:
    """[T - 1]: log p(tokens[t] | prefixes, tokens[<t]) for t >= 1, the prefixes concatenated."""
    with torch.no_grad():
        logits = model.native.forward(torch.tensor([tokens]), prefixes=[prefixes] if prefixes else None)[0]
    logp = torch.log_softmax(logits[:-1].float(), -1)
    return logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def bayes_mixture(per_cartridge: torch.Tensor, weigh_from: int = 0) -> torch.Tensor:
    """[C, T] log-probabilities of each token under each cartridge (row t predicts token t + 1)
    -> [T] under the mixture whose weights are each cartridge's likelihood of the tokens before,
    from token `weigh_from` on (uniform prior): what the engine samples from when it composes
    cartridges by mixture."""
    per_cartridge = per_cartridge.double()
    before = weights_before(per_cartridge, weigh_from)
    return torch.logsumexp(before + per_cartridge, 0) - torch.logsumexp(before, 0)


def weights_before(per_cartridge: torch.Tensor, weigh_from: int = 0) -> torch.Tensor:
    """[C, T] log-probabilities (row t predicts token t + 1) -> [C, T] each cartridge's
    log-likelihood of the tokens before row t's, from token `weigh_from` on: the mixture's
    unnormalized log-weights at each row."""
    counted = per_cartridge.double().clone()
    counted[:, :max(weigh_from - 1, 0)] = 0  # rows that predict tokens before weigh_from
    return torch.cat([torch.zeros(per_cartridge.shape[0], 1, dtype=torch.float64), counted.cumsum(1)[:, :-1]], 1)


def routed(per_cartridge: torch.Tensor, weigh_from: int, first: int) -> torch.Tensor:
    """[C, T] -> [T]: the rows of the cartridge the mixture weighs most at row `first` (the one
    that predicts the reply's first token), which then decodes alone: what the engine does when
    it composes cartridges by route (the first of equal weights)."""
    return per_cartridge[int(torch.argmax(weights_before(per_cartridge, weigh_from)[:, first]))]


def answer_logliks(model, prompts: list[list[int]], answers: list[list[int]], prefixes: list[Any],
                   composition: str = "concatenate") -> list[float]:
    """Sum of log p(answer tokens | prefixes, prompt) for each pair; several prefixes composed
    by `composition`."""
    out = []
    for prompt, answer in zip(prompts, answers):
        tokens, at = prompt + answer, slice(len(prompt) - 1, None)  # the positions that predict the answer
        if composition in ("mixture", "route") and len(prefixes) > 1:
            per_cartridge = torch.stack([token_logprobs(model, tokens, [p]) for p in prefixes])
            opening = model.engine.template_opening(prompt)  # as the engine weighs
            logp = (bayes_mixture(per_cartridge, opening) if composition == "mixture"
                    else routed(per_cartridge, opening, at.start))
        else:
            logp = token_logprobs(model, tokens, prefixes)
        out.append(float(logp[at].sum()))
    return out


def score(model, questions: list[Question], cond: Condition, max_reply: int) -> tuple[list[dict], int]:
    """Per question under one condition: the gold's log-likelihood and token count, the greedy
    reply and whether it contains the gold; and the condition's KV tokens."""
    prompts, prefixes, kv_tokens = context_prompts(model, questions, cond)
    answers = [model.tokenizer.encode(q.answer) for q in questions]
    loglik = answer_logliks(model, prompts, answers, prefixes, cond.composition)
    replies = model.generate(prompts, max_new_tokens=max_reply, prefixes=prefixes or None,
                             composition=cond.composition)
    return [{"loglik": ll, "answer_tokens": len(a), "reply": r.text, "match": contains_match(r.text, q)}
            for q, a, ll, r in zip(questions, answers, loglik, replies)], kv_tokens


def summary(per_question: list[dict], idx: list[int]) -> dict:
    """Log-likelihood per gold token and per question, and the match rate, over questions `idx`."""
    return {
        "n": len(idx),
        "loglik_per_token": sum(per_question[i]["loglik"] for i in idx)
        / sum(per_question[i]["answer_tokens"] for i in idx),
        "loglik_sum": sum(per_question[i]["loglik"] for i in idx) / len(idx),
        "match": sum(per_question[i]["match"] for i in idx) / len(idx),
    }


def kinds_of(questions: list[Question]) -> list[str]:
    return list(dict.fromkeys(q.kind for q in questions))


def report(questions: list[Question], per_question: list[dict], kv_tokens: float, started: float) -> dict:
    everything = list(range(len(questions)))
    return {
        **summary(per_question, everything),
        "by_kind": {k: summary(per_question, [i for i in everything if questions[i].kind == k])
                    for k in kinds_of(questions)},
        "kv_tokens": kv_tokens,
        "eval_s": time.perf_counter() - started,
        "per_question": per_question,
    }


def evaluate(model, questions: list[Question], cond: Condition, max_reply: int) -> dict:
    """Log-likelihood of the gold answers and contains-match of greedy replies, overall and by kind."""
    started = time.perf_counter()
    per_question, kv_tokens = score(model, questions, cond, max_reply)
    return report(questions, per_question, kv_tokens, started)


def evaluate_each(model, questions: list[Question], conds: list[Condition], max_reply: int) -> dict:
    """As evaluate(), with each question under its own condition (its section, its retrieved
    chunks); questions with the same condition share its KV. kv_tokens is the mean over questions."""
    started = time.perf_counter()
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(conds):
        groups.setdefault((c.system, tuple(map(id, c.prefixes)), c.composition), []).append(i)
    per_question: list[dict] = [{}] * len(questions)
    kv_total = 0
    for idx in groups.values():
        scored, kv_tokens = score(model, [questions[i] for i in idx], conds[idx[0]], max_reply)
        for i, s in zip(idx, scored):
            per_question[i] = s
        kv_total += kv_tokens * len(idx)
    return report(questions, per_question, kv_total / max(1, len(questions)), started)


def recovered(value: float, none: float, full: float) -> float:
    return (value - none) / (full - none) if full != none else float("nan")


def add_recovered(conds: dict[str, dict], full: str) -> dict:
    """(condition - none) / (`full` - none), overall and by kind, for every other condition."""
    none, top = conds["none"], conds[full]
    return {
        name: {
            "all": recovered(c["loglik_per_token"], none["loglik_per_token"], top["loglik_per_token"]),
            "by_kind": {k: recovered(v["loglik_per_token"], none["by_kind"][k]["loglik_per_token"],
                                     top["by_kind"][k]["loglik_per_token"]) for k, v in c["by_kind"].items()},
        }
        for name, c in conds.items() if name not in ("none", full)
    }


# -- cartridges -----------------------------------------------------------------------------

def kv_bytes_per_token(model) -> int:
    c = model.native.config
    element = torch.empty((), dtype=getattr(torch, model.dtype)).element_size()
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def cached_result(directory: Path, stem: str, key: list, run) -> dict:
    """`run()`'s figures, kept in `directory` as STEM-HASH.json under a hash of `key` (all that
    they depend on) and read from there when a run with the same key made them before."""
    blob = json.dumps(key, sort_keys=True).encode()
    path = directory / f"{stem}-{hashlib.sha256(blob).hexdigest()[:12]}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = run()
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def cartridge_key(model, text: str, config: TrainConfig) -> str:
    blob = json.dumps([model.fingerprint, text, keyed_fields(config)], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def for_text(model, text: str, config: TrainConfig) -> TrainConfig:
    """`config` with what it leaves to the document (cartridge length, conversations, epochs,
    the dtype trained in) decided as training decides it, so that the baselines and the caches
    see the same run: a config that decides to one trained before reuses its cartridge."""
    return decided_config(config, len(Corpus.from_texts(model.tokenizer, [text])), native_model(model))


class StageLog:
    """A training run's progress as lines on stderr, for runs whose output goes to a file: each
    stage's start and every tenth of it, with the seconds since the run began."""

    def __init__(self, name: str) -> None:
        self.name, self.t0, self.last = name, time.perf_counter(), ("", -1)

    def __call__(self, stage: str, done: int, total: int, loss: float | None = None) -> None:
        tenth = done * 10 // max(total, 1)
        if (stage, tenth) == self.last:
            return
        self.last = (stage, tenth)
        loss_text = "" if loss is None else f", loss {loss:.4f}"
        print(f"[{self.name}] {stage} {done}/{total} at {time.perf_counter() - self.t0:.0f} s{loss_text}",
              file=sys.stderr, flush=True)


def get_cartridge(model, name: str, text: str, config: TrainConfig, directory: Path) -> tuple[Cartridge, dict]:
    """The trained cartridge of document `name` under `config`, from `directory` when it was
    trained before; an interrupted training resumes from its checkpoint."""
    config = for_text(model, text, config)
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / f"{name}-{cartridge_key(model, text, config)}"
    path, stats_path = base.with_suffix(".safetensors"), base.with_suffix(".json")
    if path.exists() and stats_path.exists():
        print(f"[{name}] cartridge from {path}", file=sys.stderr)
        return Cartridge.load(path, model), {**json.loads(stats_path.read_text()), "cached": True}
    checkpoint = base.with_suffix(".ckpt")
    # Synthesized data is kept apart, under a key of what synthesis depends on: settings that
    # change training only (lr, epochs, ...) reuse it.
    synthesis = {k: v for k, v in keyed_fields(config).items() if k not in TRAINING_ONLY_FIELDS}
    data_key = hashlib.sha256(json.dumps([model.fingerprint, text, synthesis], sort_keys=True).encode()).hexdigest()[:12]
    data_path = directory / f"{name}-data-{data_key}.pt"
    data = held_out = None
    if data_path.exists():
        saved = torch.load(data_path, weights_only=True)
        data = cartridges_core.TrainingData(**saved["data"])
        held_out = cartridges_core.TrainingData(**saved["held_out"]) if saved["held_out"] else None
        print(f"[{name}] training on the synthesized data of {data_path}", file=sys.stderr)
    else:
        print(f"[{name}] synthesis ({config.num_samples} conversations) and training", file=sys.stderr)
    # A terminal shows progress bars; output that goes to a file gets a line per tenth of a stage.
    log = None if sys.stderr.isatty() else StageLog(name)
    cart = cartridges.train(model, [text], config, progress=True, on_progress=log, checkpoint=checkpoint,
                            resume=True, data=data, held_out=held_out)
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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--set FIELD=VALUE items as TrainConfig fields of their types ("none" for a field that
    may be left to the corpus); a bad field or value stops with what is wrong."""
    raw: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes FIELD=VALUE with a TrainConfig field; got {item!r}")
        raw[field_aliases().get(key, key)] = None if value.lower() in ("none", "null") else value
    try:
        parsed = TrainConfig.model_validate(raw, strict=False)  # the strings as their fields' types
    except ValidationError as error:
        raise SystemExit(f"--set: {describe(error)} (fields: {', '.join(TrainConfig.model_fields)})") from None
    return {key: getattr(parsed, key) for key in raw}


def suite_arguments(description: str, docs_dir: Path, all_docs: tuple[str, ...],
                    tune: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options both suites take: which documents (and which of them tune), training
    overrides, where cartridges are cached, reply length, threads, device, output, the documents' check."""
    def names_list(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        for n in names:
            if not (docs_dir / f"{n}.md").exists():
                raise argparse.ArgumentTypeError(f"no document {n!r} in {docs_dir}")
        return names

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=names_list, default=list(all_docs), help="documents to evaluate (comma-separated)")
    parser.add_argument("--tune", type=names_list, default=list(tune),
                        help="the tuning subset (choose settings on these); the others are reported as held out")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="a TrainConfig field for training (repeatable), e.g. --set num_samples=64")
    parser.add_argument("--cartridge-dir", type=Path, default=Path("benchmarks/.cartridges"),
                        help="where trained cartridges are kept and reused (default: %(default)s)")
    parser.add_argument("--max-reply", type=int, default=48, help="greedy reply tokens for the contains-match")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (default: all cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model runs and trains: cpu (float32) or cuda (bfloat16) (default: %(default)s)")
    parser.add_argument("--out", metavar="PATH", help="write every figure (and every reply) as JSON here")
    parser.add_argument("--check-docs", action="store_true",
                        help="only check the documents (token counts, kinds, literal answers in the text) and exit")
    parser.names_list = names_list  # type: ignore[attr-defined]  # for the suite's own options
    return parser


def suite_model(args: argparse.Namespace) -> Any:
    """The model of a suite's run, on --device with --threads. Off the CPU, cached results and
    cartridges go to a folder of their own under --cartridge-dir: the cache keys name the
    weights, not where they ran."""
    torch.set_num_threads(args.threads)  # before the engine starts: its compute thread follows it
    if args.device != "cpu":
        args.cartridge_dir = args.cartridge_dir / args.device
    return cartridges.load_model(device=args.device)
