"""Composition by mixture, measured offline against composition by concatenation.

Two documents' cartridges (the suite's, trained with the defaults or taken from
--cartridge-dir) answer each document's questions in three ways, scored like the suite
(log-likelihood of the gold answers, teacher-forced) as the fraction of the single-cartridge
gain kept:
- concatenated: both cartridges' KV in front of one sequence (composition="concatenate");
- uniform mixture: each cartridge on its own sequence, next-token probabilities averaged;
- Bayesian mixture over everything (bayes_all): the same, each cartridge weighted by the
  likelihood it gave to everything before the token (chat template, question, answer so far);
- Bayesian mixture (bayes): weighted from the question on, past the chat template's opening
  and its system prompt: the engine's composition by mixture, the default.

    python benchmarks/compose_mixture.py --compose narrative,manual --cartridge-dir DIR
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

import cartridges
from cartridges.selfstudy import TrainConfig
from eval_cartridge import bayes_mixture, chat_prompts, get_cartridge, load_document, names_list, parse_overrides, \
    token_logprobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compose", type=names_list, default=["narrative", "manual"], metavar="A,B")
    parser.add_argument("--cartridge-dir", type=Path, default=Path("benchmarks/.cartridges"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = cartridges.load_model()
    config = TrainConfig(**parse_overrides(args.overrides))
    docs = {n: load_document(n) for n in args.compose}
    carts = {n: get_cartridge(model, docs[n], config, args.cartridge_dir)[0].prefix(model) for n in args.compose}
    for name in args.compose:
        questions = docs[name].questions
        prompts = chat_prompts(model, questions, None)
        totals = dict.fromkeys(("none", "single", "concatenated", "uniform", "bayes_all", "bayes"), 0.0)
        answer_tokens = 0
        for prompt, question in zip(prompts, questions):
            answer = model.tokenizer.encode(question.answer)
            tokens = prompt + answer
            at = slice(len(prompt) - 1, len(tokens) - 1)  # the positions that predict the answer
            each = torch.stack([token_logprobs(model, tokens, [carts[n]]) for n in args.compose])
            totals["none"] += float(token_logprobs(model, tokens, [])[at].sum())
            totals["single"] += float(each[args.compose.index(name), at].sum())
            totals["concatenated"] += float(token_logprobs(model, tokens, list(carts.values()))[at].sum())
            totals["uniform"] += float((torch.logsumexp(each, 0) - math.log(len(carts)))[at].sum())
            totals["bayes_all"] += float(bayes_mixture(each)[at].sum())
            totals["bayes"] += float(bayes_mixture(each, model.engine.template_opening(prompt))[at].sum())
            answer_tokens += len(answer)
        per_token = {k: v / answer_tokens for k, v in totals.items()}
        gain = per_token["single"] - per_token["none"]
        kept = {k: (per_token[k] - per_token["none"]) / gain for k in ("concatenated", "uniform", "bayes_all", "bayes")}
        print(f"{name}: single gain {gain:.3f} nats/token; kept: "
              + ", ".join(f"{k} {v:.2f}" for k, v in kept.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
