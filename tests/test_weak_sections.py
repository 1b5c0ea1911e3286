"""benchmarks/weak_sections.py finds, in a result file of the long-corpus suite, the question that
holds a weak section down, and the section's share without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def question(section: int, none: float, oracle: float, parts: float, answer: str) -> dict:
    scored = lambda loglik: {"loglik": loglik, "answer_tokens": 1, "reply": "a reply", "match": False}  # noqa: E731
    return {"question": "?", "answer": answer, "kind": "literal", "sections": [section],
            "none": scored(none), "oracle": scored(oracle), "parts": scored(parts)}


def test_a_weak_section_names_the_question_below_no_context(tmp_path):
    # Section 1: two questions recover 0.8 of the oracle's gain, a third falls 3 nats below no
    # context: the section's share is (2 * 1.6 - 3) / 6 = 0.03, and 0.8 without that question.
    # Section 2 recovers all of it and is not reported.
    questions = [question(1, -4.0, -2.0, -2.4, "Kept"), question(1, -4.0, -2.0, -2.4, "Kept too"),
                 question(1, -4.0, -2.0, -7.0, "Wakeful Heron"), question(2, -4.0, -2.0, -2.0, "Fine")]
    result = {"documents": {"doc": {"per_question": questions,
                                    "recovered": {"parts": {"by_section": {"1": 0.2 / 6, "2": 1.0}}}}}}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "weak_sections.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "1 of 4 questions over a nat a token below no context" in out
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert "Wakeful Heron" in row and "| -3.0 |" in row and row.endswith("| 0.80 |")
    assert not any(line.startswith("| 2 |") for line in out.splitlines())
    assert "1 sections under 0.3; 1 reach it" in out
    # Drawn again with replacement, section 1 stays under the floor unless the draw misses the wrong
    # answer ((2/3)^3 of draws): about 70%; section 2 never. So the count is 1, or 0 in 30% of draws.
    chance = float(row.split("|")[5].strip().rstrip("%"))
    assert 65 <= chance <= 75
    assert "sections under 0.3: 1 of 2; with each section's questions drawn again (2000 draws): median 1, " \
           "90% of draws 0-1" in out


def test_against_a_baseline_lists_the_questions_below_no_context_in_either_run(tmp_path):
    def result(wakeful: float, fine: float) -> dict:
        questions = [question(1, -4.0, -2.0, -2.4, "Kept"), question(1, -4.0, -2.0, wakeful, "Wakeful Heron"),
                     question(2, -4.0, -2.0, fine, "Fine")]
        return {"documents": {"doc": {"per_question": questions, "recovered": {"parts": {"by_section": {}}}}}}

    (tmp_path / "base.json").write_text(json.dumps(result(-7.0, -2.0)))  # the heron 3 nats below
    (tmp_path / "new.json").write_text(json.dumps(result(-3.0, -5.5)))  # mended; "Fine" falls 1.5 below
    out = subprocess.run([sys.executable, str(BENCHMARKS / "weak_sections.py"), str(tmp_path / "new.json"),
                          "--against", str(tmp_path / "base.json")], capture_output=True, text=True, check=True).stdout
    assert "| 1 | literal | Wakeful Heron | -3.0 | 1.0 |" in out
    assert "| 2 | literal | Fine | 2.0 | -1.5 |" in out
    assert "| 1 | literal | Kept |" not in out
    assert "below in base.json: 1; in new.json: 1; in both: 0" in out
