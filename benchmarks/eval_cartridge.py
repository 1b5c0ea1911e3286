"""Cartridge evaluation: does a cartridge trained by self-study recover the in-context gain?

A generated document of invented facts (people, towns, years, pets: nothing a model can
know) and held-out questions with gold answers. For each question, on the default model:
  (a) no context, (b) the document in context, (c) the trained cartridge in front;
the mean log-likelihood of the gold answer (per token, and summed) and a match rate (the
greedy answer contains the gold string). Plus KV bytes of (b) and (c) and wall times.

    python benchmarks/eval_cartridge.py                       # the recorded configuration
    python benchmarks/eval_cartridge.py --num-samples 32 --epochs 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

import cartridges
from cartridges.cartridge import Cartridge
from cartridges.selfstudy import Corpus, TrainConfig
from cartridges.training import init_params
from cartridges.selfstudy.prompts import SYSTEM_PROMPT
from cartridges.selfstudy.synthesize import common_prefix_len

ROLES = ["harbor master", "lamp keeper", "archivist", "bell founder", "ferry captain", "salt merchant",
         "glassblower", "beekeeper", "cartographer", "rope maker", "clock mender", "orchard warden"]
ANIMALS = ["heron", "goat", "fox", "tortoise", "owl", "ferret", "donkey", "crow", "hare", "otter"]
COLORS = ["amber", "teal", "crimson", "ochre", "violet", "silver", "olive", "indigo"]
SYL = ["vel", "dra", "mon", "ast", "qui", "bel", "tor", "ix", "zan", "lo", "rem", "fa", "ung", "sor", "pel", "yth",
       "kar", "oss", "miv", "tal"]


def invent(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYL) for _ in range(parts)).capitalize()


def make_document(seed: int = 0, num_people: int = 40) -> tuple[str, list[tuple[str, str]]]:
    """Prose about invented people and towns, and (question, gold answer) pairs about it."""
    rng = random.Random(seed)
    towns = sorted({invent(rng, 2) + rng.choice(["port", "wick", "holm", "mere"]) for _ in range(14)})
    used: set[str] = set()
    paragraphs, questions = [], []
    paragraphs.append(
        "The Register of the Ninefold Coast. This register records the keepers of the coast towns, "
        "as collected by the council of the coast. Every entry below was checked by two clerks."
    )
    for _ in range(num_people):
        while True:
            first, last = invent(rng, 2), invent(rng, 3)
            if first not in used:
                used.add(first)
                break
        name = f"{first} {last}"
        role, town, animal = rng.choice(ROLES), rng.choice(towns), rng.choice(ANIMALS)
        pet, year = invent(rng, 2), rng.randint(1702, 1899)
        color, boats = rng.choice(COLORS), rng.randint(3, 19)
        paragraphs.append(
            f"{name} served as the {role} of {town}, starting in the year {year}. "
            f"{first} kept a {animal} called {pet}, and painted the door of the workshop {color}. "
            f"Under {first}, {town} owned {boats} boats."
        )
        questions += [
            (f"What was the name of the {animal} that {name} kept?", pet),
            (f"In which year did {name} start as the {role} of {town}?", str(year)),
            (f"Of which town was {name} the {role}?", town),
            (f"What color was the door of {name}'s workshop?", color),
        ]
    rng.shuffle(questions)
    return "\n\n".join(paragraphs), questions


def answer_loglik(model, prompts: list[list[int]], answers: list[list[int]], prefixes) -> list[float]:
    """Sum of log p(answer tokens | prompt) for each pair, with optional prefixes."""
    out = []
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers):
            tokens = torch.tensor([prompt + answer])
            logits = model.core.forward(tokens, prefixes=[prefixes] if prefixes else None)[0]
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            out.append(float(logp.gather(1, torch.tensor(answer)[:, None]).sum()))
    return out


def normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation: the form exact match compares."""
    return " ".join(text.lower().split()).strip(" .,;:!?\"'")


def evaluate(model, questions, condition: str, document: str, prefixes) -> dict:
    tok = model.tokenizer
    prompts, answers = [], []
    for q, gold in questions:
        messages = [{"role": "user", "content": q}]
        if condition == "in_context":
            messages = [{"role": "system", "content": SYSTEM_PROMPT.format(chunk=document)}, *messages]
        prompts.append(tok.encode_chat(messages, add_generation_prompt=True))
        answers.append(tok.encode(gold))  # the gold answer as the reply's first tokens
    t0 = time.perf_counter()
    if condition == "in_context":
        # The document is the same for every question: its KV is computed once, as a prefix
        # (the same numbers as prefilling it with each question, a fraction of the time).
        shared = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        prefixes = [model.core.prefix_from_tokens(torch.tensor(prompts[0][:shared]))]
        prompts = [p[shared:] for p in prompts]
    loglik = answer_loglik(model, prompts, answers, prefixes)
    replies = []
    for i in range(0, len(prompts), 8):
        batch = prompts[i : i + 8]
        replies += model.generate(batch, max_new_tokens=24, prefixes=prefixes or None)
    matches = [gold.lower() in r.text.lower() for (_, gold), r in zip(questions, replies)]
    exact = [normalize(gold) == normalize(r.text) for (_, gold), r in zip(questions, replies)]
    return {
        "loglik_sum": sum(loglik) / len(loglik),
        "loglik_per_token": sum(loglik) / sum(len(a) for a in answers),
        "match": sum(matches) / len(matches),
        "exact_match": sum(exact) / len(exact),
        "eval_s": time.perf_counter() - t0,
        "examples": [(q, gold, r.text) for (q, gold), r in list(zip(questions, replies))[:3]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=256)
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--chunk-min", type=int, default=512)
    parser.add_argument("--chunk-max", type=int, default=1024)
    parser.add_argument("--synthesis-batch", type=int, default=16)
    parser.add_argument("--max-question", type=int, default=32)
    parser.add_argument("--max-answer", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--lrs", type=float, nargs="+", metavar="LR",
                        help="train one cartridge per learning rate on the same synthesized data (overrides --lr)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--objective", default="distill", choices=["distill", "next_token"])
    parser.add_argument("--init", default="corpus", choices=["corpus", "text"])
    parser.add_argument("--num-questions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="write the trained cartridge here")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = cartridges.load_model()
    document, questions = make_document()
    questions = questions[: args.num_questions]
    doc_tokens = len(model.tokenizer.encode(document))
    c = model.core.config
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # float32
    print(f"document: {doc_tokens} tokens, {len(questions)} held-out questions", file=sys.stderr)

    config = TrainConfig(
        num_tokens=args.num_tokens, num_samples=args.num_samples, chunk_min_tokens=args.chunk_min,
        chunk_max_tokens=args.chunk_max, synthesis_batch_size=args.synthesis_batch,
        max_question_tokens=args.max_question, max_answer_tokens=args.max_answer, lr=args.lr,
        epochs=args.epochs, batch_size=args.batch_size, objective=args.objective, init=args.init, seed=args.seed,
    )
    baselines = {cond: evaluate(model, questions, cond, document, None) for cond in ("no_context", "in_context")}
    # The untrained cartridge: what initialization alone gives.
    init = Cartridge.from_params(init_params(model, Corpus.from_texts(model.tokenizer, [document]), config), "", {})
    baselines["init_only"] = evaluate(model, questions, "cartridge", document, [init.prefix(model)])
    for cond, figures in baselines.items():
        print(cond, {k: v for k, v in figures.items() if k != "examples"}, file=sys.stderr)
    runs = []
    data = None  # synthesized once, reused for every learning rate
    for lr in args.lrs or [args.lr]:
        config.lr = lr
        cart = cartridges.train(model, [document], config, progress=True, data=data)
        synthesis_s = cart.stats["synthesis_s"] if data is None else runs[0]["synthesis_s"]
        data = cart.stats["data"]
        if args.save:
            cart.save(args.save if len(args.lrs or []) < 2 else f"{args.save}.lr{lr:g}")
        results = {
            "config": config.to_dict(),
            "document_tokens": doc_tokens,
            "kv_bytes_in_context": doc_tokens * kv_per_token,
            "kv_bytes_cartridge": cart.nbytes,
            "synthesis_s": synthesis_s,
            "training_s": cart.stats["training_s"],
            "losses_first_last": [cart.stats["losses"][0], cart.stats["losses"][-1]],
            "steps": cart.stats["steps"],
            **baselines,
            "cartridge": evaluate(model, questions, "cartridge", document, [cart.prefix(model)]),
        }
        print(f"lr {lr:g} cartridge", {k: v for k, v in results["cartridge"].items() if k != "examples"},
              file=sys.stderr)
        a, b, cc = (results[k]["loglik_per_token"] for k in ("no_context", "in_context", "cartridge"))
        results["recovered_loglik_gain"] = (cc - a) / (b - a) if b != a else float("nan")
        results["kv_ratio"] = results["kv_bytes_in_context"] / results["kv_bytes_cartridge"]
        runs.append(results)
    results = runs[0] if len(runs) == 1 else {"runs": runs}
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
