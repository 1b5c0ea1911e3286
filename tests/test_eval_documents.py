"""The long-corpus evaluation suite's documents keep its rules (sizes, questions per section,
every kind, multi-hop questions far apart, literal answers in their sections), and what the
suite builds from them (sections, retrieval chunks) is what it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eval_long():
    sys.path.insert(0, str(BENCHMARKS))  # eval_long imports its sibling, evaluation.py
    try:
        spec = importlib.util.spec_from_file_location("eval_long", BENCHMARKS / "eval_long.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["eval_long"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("eval_long", None)


@pytest.fixture(scope="module")
def model():
    import cartridges

    return cartridges.load_model()


def test_the_long_documents_keep_the_suite_rules(eval_long, model, capsys):
    assert eval_long.check_docs(model, list(eval_long.ALL_DOCS)) == 0, capsys.readouterr().out
    held_out = set(eval_long.ALL_DOCS) - set(eval_long.DEFAULT_TUNE)
    assert held_out, "at least one document is held out from every tuning decision"


def test_sections_are_numbered_in_order(eval_long):
    text = "# T\n\nintro\n\n## 1. A\n\nalpha\n\n## 2. B\n\nbeta\n"
    assert eval_long.split_sections(text) == ["## 1. A\n\nalpha", "## 2. B\n\nbeta"]
    with pytest.raises(ValueError, match="numbered"):
        eval_long.split_sections("## 1. A\n\n## 3. C\n")


def test_retrieval_chunks_cover_the_corpus_in_about_300_tokens(eval_long, model):
    from cartridges.retrieval import CHUNK_TOKENS, split_chunks

    doc = eval_long.load_document("atlas")
    chunks = split_chunks(model.tokenizer, doc.text)
    sizes = [len(model.tokenizer.encode(c)) for c in chunks]
    assert max(sizes) <= CHUNK_TOKENS + 8  # joined paragraphs re-tokenize a little apart
    assert sum(sizes) / len(sizes) > 0.6 * CHUNK_TOKENS
    # Every paragraph of the corpus is in a chunk, in order.
    joined = "\n\n".join(chunks)
    paragraphs = [p.strip() for p in doc.text.split("\n\n") if p.strip()]
    assert all(p in joined for p in paragraphs if len(model.tokenizer.encode(p)) <= 300)
    # BM25 finds the chunk that states a literal answer for most literal questions.
    literal = [q for q in doc.questions if q.kind == "literal"]
    retrieved = eval_long.retrieve(model, doc.text, literal)
    found = [any(q.answer.lower() in c.lower() for c in chunks) for q, chunks in zip(literal, retrieved)]
    assert sum(found) >= 0.8 * len(literal), sum(found)
    assert all(len(c) == eval_long.RETRIEVAL_TOP_K for c in retrieved)


def test_the_kind_table_shows_the_oracles_gain_in_nats(eval_long, capsys):
    """Beside each kind's recovered shares, the oracle's own gain over no context: where it is
    small (numeric questions on the rulebook, about 0.3 nats a token against 4.6 for literal
    ones) a recovered share is a ratio of small differences."""
    import json

    results = BENCHMARKS / "results"
    doc = json.loads((results / "eval_long_rulebook_baselines.json").read_text())["documents"]["rulebook"]
    eval_long.print_tables("rulebook", doc)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and " | " in line}
    kinds = doc["conditions"]["oracle"]["by_kind"]
    for kind in ("literal", "numeric"):
        want = kinds[kind]["loglik_per_token"] - doc["conditions"]["none"]["by_kind"][kind]["loglik_per_token"]
        assert float(rows[kind][2]) == pytest.approx(want, abs=0.005)
    assert float(rows["numeric"][2]) < 0.5 < 4 < float(rows["literal"][2])


def test_the_access_probe_cues_the_gold_by_its_sentences_first_eight_words(eval_long):
    spec = importlib.util.spec_from_file_location("probe_recall_access", BENCHMARKS / "probe_recall_access.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    section = ("## 11. Accidents\n\nThe gang is called out at once. It consists of a tool van, a riding van "
               "for ten men, and the crane known as Old Marrable, which lifts 12 tonnes.")
    cue, lead = probe.recall_form(section, "Old Marrable")
    assert cue == "It consists of a tool van, a riding"
    assert lead == "van for ten men, and the crane known as"
    assert probe.recall_form(section, "12 tonnes")[0] == cue  # the sentence that holds it, not the first
    assert probe.recall_form(section, "tool van") is None  # within the cue: nothing to go on with
    assert probe.recall_form(section, "Tidegate") is None  # not written there


def test_exact_answers_other_than_yes_no_leave_those_questions_out(eval_long):
    per_question = [{"kind": "yes_no", "a": {"match": True}}, {"kind": "literal", "a": {"match": True}},
                    {"kind": "numeric", "a": {"match": False}}, {"kind": "literal", "b": {"match": True}}]
    d = {"per_question": per_question}
    assert eval_long.match_not_yes_no(d, "a") == 0.5
    assert eval_long.match_not_yes_no(d, "b") == 1.0


def test_corpus_parts_cut_the_long_documents_between_sections_with_the_opening(eval_long, model):
    """The parts the suite's `parts` condition trains (cartridges.parts, as `cartridges train
    --parts` cuts): whole "## N." sections after the corpus' opening, never a subsection."""
    from cartridges.parts import DEFAULT_PART_CONTEXTS, corpus_parts

    doc = eval_long.load_document("chronicle")
    limit = DEFAULT_PART_CONTEXTS * model.context_length
    parts = corpus_parts(model.tokenizer, doc.text, limit)
    total = len(model.tokenizer.encode(doc.text))
    assert len(parts) == -(-total // limit)  # the fewest parts of the limit or fewer
    opening = doc.text[:doc.text.index("## 1. ")].strip()
    assert all(p.startswith(opening + "\n\n## ") for p in parts)  # each says what it is a part of
    # Every section once, whole and in order.
    assert "\n\n".join(p[len(opening) + 2:] for p in parts) == "\n\n".join(doc.sections)
    sizes = [len(model.tokenizer.encode(p)) for p in parts]
    assert max(sizes) <= 1.1 * min(sizes)


def test_baselines_only_with_a_trained_condition_asked_for_is_refused(eval_long, monkeypatch, capsys):
    """--baselines-only trains nothing: asking for parts (or the cartridge) with it is an error,
    not a run that leaves them out without a word."""
    monkeypatch.setattr(sys, "argv", ["eval_long.py", "--docs", "atlas", "--conditions", "parts", "--baselines-only"])
    with pytest.raises(SystemExit) as stopped:
        eval_long.main()
    assert stopped.value.code == 2 and "parts need training" in capsys.readouterr().err


def test_parts_route_is_scored_as_the_engine_routes(eval_long, model):
    """The parts-route condition scores a reply under the part the mixture weighs most before
    it (weighed from the template's opening on), which then decodes alone: the part the engine
    routes to."""
    import torch

    evaluation = sys.modules["evaluation"]
    rows = torch.tensor([[-9.0, -1.0, -1.0, -3.0], [-1.0, -2.0, -1.5, -0.5]])  # row t predicts token t + 1
    assert torch.equal(evaluation.routed(rows, 0, 3), rows[1])  # before row 3: -11 against -4.5
    assert torch.equal(evaluation.routed(rows, 2, 3), rows[0])  # from token 2 on: -2 against -3.5
    texts = ["The harbour of Tessel closes at dusk in the winter months and opens at dawn.",
             "The keeper of the Quelmor light is Ansel Varrow, who has kept it for thirty years."]
    prefixes = [model.native.prefix_from_tokens(torch.tensor(model.tokenizer.encode(t))) for t in texts]
    prompt = model.encode_chat([{"role": "user", "content": "Who keeps the Quelmor light?"}])

    def reply(parts, composition="mixture"):
        return model.generate([prompt], max_new_tokens=8, stop_token_ids=[], prefixes=parts,
                              composition=composition, logprobs=1)[0]

    routed_reply, light_alone = reply(prefixes, "route"), reply(prefixes[1:])
    assert routed_reply.tokens == light_alone.tokens  # the engine routes to the light's text
    assert [t.logprob for t in routed_reply.logprobs] == pytest.approx([t.logprob for t in light_alone.logprobs],
                                                                       abs=1e-4)
    [routed] = evaluation.answer_logliks(model, [prompt], [routed_reply.tokens], prefixes, "route")
    harbour, light = (evaluation.answer_logliks(model, [prompt], [routed_reply.tokens], [p])[0] for p in prefixes)
    assert routed == light and light > harbour  # the suite routes to it too
