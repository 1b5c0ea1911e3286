"""Model loading: Hugging Face directories and GGUF files → config, float32 weights under
Hugging Face names, and a chat tokenizer. Python, with the core decoding GGUF's quantized
blocks; the C++ model takes it from here."""

from __future__ import annotations

import os
from pathlib import Path

from .config import ModelConfig
from .default import default_model_path
from .errors import ModelLoadError
from .gguf_loader import load_gguf
from .hf import load_hf_dir
from .loaded import LoadedModel
from .tokenizer import ChatTokenizer, StreamDecoder

__all__ = [
    "ChatTokenizer",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "StreamDecoder",
    "default_model_path",
    "load_gguf",
    "load_hf_dir",
    "load_weights",
]


def load_weights(path: str | os.PathLike[str] | None = None) -> LoadedModel:
    """Load a model: None → the default GGUF; a directory → Hugging Face; *.gguf → GGUF."""
    if path is None:
        return load_gguf(default_model_path())
    p = Path(path)
    if p.is_dir():
        return load_hf_dir(p)
    if p.suffix.lower() == ".gguf":
        return load_gguf(p)
    if not p.exists():
        raise ModelLoadError(p, "no such file or directory")
    raise ModelLoadError(p, "expected a Hugging Face model directory or a .gguf file")
