"""Does a trained cartridge hold the facts it misses as text to go on with, where a question
cannot reach them? For each question of a long document (not yes/no) whose gold answer is
written in its section after a sentence's first eight words, the gold's log p is taken in
two forms:

  recall    the student's recall message ('Continue this passage...' with those eight words)
            and the section's text up to the gold as the answer's start: what self-study's
            recall conversations teach
  question  the eval's question, from an eval_long.py result (its none, oracle and cartridge
            log-likelihoods)

each as the share of the in-context gain it recovers over no context (recall: the section in
the teacher's system prompt; question: the oracle). Near 1 in recall form and well below in
question form means the cartridge stores the fact but the question does not reach it.

    python benchmarks/probe_recall_access.py --doc rulebook \\
        --cartridge benchmarks/.cartridges/rulebook-KEY.safetensors \\
        --results benchmarks/results/eval_long_rulebook_fused_seed1.json

eval_long.py keeps each trained cartridge under --cartridge-dir (benchmarks/.cartridges) as
DOC-KEY.safetensors, KEY a hash of the model, the text and the config.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch

import cartridges
from cartridges.cartridge import Cartridge
from cartridges.selfstudy.prompts import RECALL_CUE_WORDS, RECALL_TEMPLATES, SENTENCE_START, SYSTEM_PROMPT
from cartridges.selfstudy.synthesize import student_tokens
from eval_long import load_document
from evaluation import recovered, token_logprobs


def recall_form(section: str, gold: str) -> tuple[str, str] | None:
    """(cue, lead): the first RECALL_CUE_WORDS words of the sentence in `section` that holds
    the first occurrence of `gold`, and the text between the cue and the gold; None when `gold`
    is not written there or lies within the cue."""
    found = re.search(r"\b" + re.escape(gold) + r"\b", section)
    if not found:
        return None
    starts = [s.end() for s in SENTENCE_START.finditer(section) if s.end() <= found.start()]
    if not starts:
        return None
    words = list(re.finditer(r"\S+", section[starts[-1] : found.start()]))
    if len(words) <= RECALL_CUE_WORDS:
        return None
    cue_end = starts[-1] + words[RECALL_CUE_WORDS - 1].end()
    return " ".join(section[starts[-1] : cue_end].split()), section[cue_end : found.start()].strip()


def gold_logprob(model, prompt: list[int], lead: str, gold: str, prefixes: list) -> float:
    """log p of the gold's tokens after `prompt` and the answer's `lead`, under `prefixes`."""
    tok = model.tokenizer
    answer = tok.encode(f"{lead} {gold}" if lead else gold)
    n_gold = len(answer) - (len(tok.encode(lead)) if lead else 0)
    tokens = prompt + answer
    return float(token_logprobs(model, tokens, prefixes)[len(tokens) - 1 - n_gold :].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", required=True, help="a document of benchmarks/eval_docs/long/")
    parser.add_argument("--cartridge", type=Path, required=True, help="the trained cartridge (.safetensors)")
    parser.add_argument("--results", type=Path, required=True,
                        help="eval_long.py's result for that cartridge (none, oracle and cartridge per question)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    documents = json.loads(args.results.read_text())["documents"]
    if args.doc not in documents or "cartridge" not in documents[args.doc]["conditions"]:
        parser.error(f"{args.results} holds no cartridge scores for {args.doc!r} (it has: {', '.join(documents)})")
    scored = {q["question"]: q for q in documents[args.doc]["per_question"]}
    torch.set_num_threads(args.threads)
    model = cartridges.load_model()
    doc = load_document(args.doc)
    prefix = Cartridge.load(args.cartridge, model).prefix(model)
    rows = []
    for q in doc.questions:
        if q.kind == "yes_no" or q.question not in scored:
            continue
        section = doc.section_text(tuple(q.sections))
        form = recall_form(section, q.answer)
        if form is None:
            continue
        cue, lead = form
        message = RECALL_TEMPLATES[0].format(cue=cue)
        student = student_tokens(model.tokenizer, message)
        teacher = list(model.tokenizer.encode_chat([{"role": "system", "content": SYSTEM_PROMPT.format(chunk=section)},
                                                    {"role": "user", "content": message}], add_generation_prompt=True))
        none, cart = (gold_logprob(model, student, lead, q.answer, p) for p in ([], [prefix]))
        full = gold_logprob(model, teacher, lead, q.answer, [])
        s = scored[q.question]
        rows.append(dict(kind=q.kind, gold=q.answer, none=none, cartridge=cart, teacher=full,
                         recall=recovered(cart, none, full), question_gain=s["oracle"]["loglik"] - s["none"]["loglik"],
                         question=recovered(s["cartridge"]["loglik"], s["none"]["loglik"], s["oracle"]["loglik"])))
    print("| kind | gold | recall form: none / cartridge / in context | recovered, recall form | question form |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['gold']} | {r['none']:.1f} / {r['cartridge']:.1f} / {r['teacher']:.1f} | "
              f"{r['recall']:.2f} | {r['question']:.2f} |")
    # Questions where context gains more than a nat in both forms: the shares of smaller gains are noise.
    kept = [r for r in rows if r["teacher"] - r["none"] > 1 and r["question_gain"] > 1]
    if kept:
        print(f"\n{len(kept)} of {len(rows)} questions gain more than 1 nat from context in both forms; median recovered: "
              f"recall form {statistics.median(r['recall'] for r in kept):.2f}, "
              f"question form {statistics.median(r['question'] for r in kept):.2f}")


if __name__ == "__main__":
    main()
