"""Every notebook in notebooks/ runs top to bottom: its code cells, in order, in one namespace
(what a kernel would do, without needing one)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__main__"}
    output = io.StringIO()
    for index, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        with contextlib.redirect_stdout(output):
            exec(compile(source, f"{path.name}[{index}]", "exec"), namespace)
    assert output.getvalue().strip(), "the notebook printed nothing"


def test_there_are_notebooks():
    assert NOTEBOOKS
