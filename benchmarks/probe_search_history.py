"""Does the conversation's previous user message help `composition: "search"` find a follow-up's
part, and what does it cost when the conversation changes topic? Tokenizer only (BM25 over the
parts' text, as `cartridges.parts.PartSearch` ranks it), on the long-corpus suite's documents.

Two-turn conversations built from each document's single-section questions:
  follow-up  another question of the same section first, then the question without the words
             that the first one already said (what a user leaves out once the topic is set)
  bare       the same follow-up without its names too (capitalized words past the first)
  switch     a question about a section in another part first, then the question whole
A strategy is right when the part it finds holds the question's section. Strategies: the last
message alone (`last`), each chunk's score for the last message plus WEIGHT times its score for the
previous one (`wWEIGHT`), and the same only where the last message alone leaves the part in
doubt: its best chunk in another part scores at least GATE times its best chunk's score, or it
finds nothing (`gGATE`, at the first of --weights).

    python benchmarks/probe_search_history.py --docs chronicle --part-tokens 16384 --weights 0.1,0.3,0.5
    python benchmarks/probe_search_history.py --docs chronicle --weights 0.3 --gates 0.5,0.7,0.9
"""

from __future__ import annotations

import argparse
import random
import re

from eval_long import load_document  # this script's sibling

import cartridges
from cartridges.parts import corpus_parts
from cartridges.retrieval import Retriever

# Words a follow-up keeps even when the first question said them: they carry no topic.
FUNCTION_WORDS = frozenset("a an the and or but of to in on at by for from with is are was were be been it its this "
                           "that what which who whom how many much did does do when where why".split())


def follow_up(question: str, first: str) -> str:
    said = {w for w in re.findall(r"[a-z0-9]+", first.lower()) if w not in FUNCTION_WORDS}
    return " ".join(w for w in question.split() if re.sub(r"[^a-z0-9]", "", w.lower()) not in said)


def bare(question: str, first: str) -> str:
    kept = follow_up(question, first).split()
    return " ".join(kept[:1] + [w for w in kept[1:] if not w[:1].isupper()])


def part_found(retriever: Retriever, last: str, previous: str, weight: float) -> int | None:
    """The part of the chunk that scores best for `last` plus `weight` times `previous`."""
    scores: dict[tuple[str, int], float] = {}  # by chunk: its text and its part
    for query, factor in ((last, 1.0), (previous, weight)):
        if factor:
            for hit in retriever.hits(query, len(retriever.chunks)):
                scores[hit.text, hit.source] = scores.get((hit.text, hit.source), 0.0) + factor * hit.score
    return max(scores, key=scores.__getitem__)[1] if scores else None


def in_doubt(retriever: Retriever, last: str, gate: float) -> bool:
    """Whether the last message alone leaves its part in doubt: no chunk shares a word with it,
    or the best chunk of another part scores at least `gate` times the best chunk."""
    best: dict[int, float] = {}
    for hit in retriever.hits(last, len(retriever.chunks)):
        best.setdefault(hit.source, hit.score)
    scores = sorted(best.values(), reverse=True)
    return not scores or (len(scores) > 1 and scores[1] >= gate * scores[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="chronicle,university,lighthouse,navigation")
    parser.add_argument("--part-tokens", type=int, default=16384)
    parser.add_argument("--weights", default="0.3")
    parser.add_argument("--gates", default="", help="gates for the first weight (comma-separated), e.g. 0.5,0.7")
    args = parser.parse_args()
    tokenizer = cartridges.load_model().tokenizer
    weights = [float(w) for w in args.weights.split(",")]
    strategies = [("last", 0.0, None)] + [(f"w{w}", w, None) for w in weights]
    strategies += [(f"g{g}", weights[0], float(g)) for g in args.gates.split(",") if g]
    for name in args.docs.split(","):
        doc = load_document(name)
        texts = corpus_parts(tokenizer, doc.text, args.part_tokens)
        retriever = Retriever.from_texts(tokenizer, texts)
        holding = [{j for j, t in enumerate(texts) if section.splitlines()[0] in t} for section in doc.sections]
        questions = [q for q in doc.questions if len(q.sections) == 1]
        print(f"{name}: {len(texts)} parts of about {args.part_tokens} tokens, {len(questions)} questions")
        for label, fixed_weight, gate in strategies:
            rng = random.Random(0)  # the same conversations for every strategy

            def found(last: str, previous: str) -> int | None:
                doubt = gate is None or in_doubt(retriever, last, gate)
                return part_found(retriever, last, previous, fixed_weight if doubt else 0.0)
            right = {"follow-up": 0, "bare": 0, "switch": 0}
            switches = 0
            for q in questions:
                own = holding[q.sections[0] - 1]
                first = rng.choice([o for o in questions if o.sections == q.sections and o is not q]).question
                right["follow-up"] += found(follow_up(q.question, first), first) in own
                right["bare"] += found(bare(q.question, first), first) in own
                elsewhere = [o for o in questions if not holding[o.sections[0] - 1] & own]
                if elsewhere:
                    switches += 1
                    right["switch"] += found(q.question, rng.choice(elsewhere).question) in own
            print(f"  {label:6s} follow-up {right['follow-up'] / len(questions):6.1%}   bare "
                  f"{right['bare'] / len(questions):6.1%}   switch {right['switch'] / max(switches, 1):6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
