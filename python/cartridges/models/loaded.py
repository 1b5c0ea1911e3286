"""`LoadedModel`: what every loader returns, and the checks they share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .tokenizer import ChatTokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names → float32, contiguous
    tokenizer: ChatTokenizer
    source: Path  # the directory or .gguf file it came from


def check_tensors(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike[str],
    origin: dict[str, str] | None = None,
) -> None:
    """Raise ModelLoadError unless `tensors` holds every weight `config` needs, each with its
    shape. `origin` maps a name to the file it came from, to name that file in the error."""
    for name, shape in config.expected_tensors().items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(path, f"missing tensor '{name}'")
        if tuple(tensor.shape) != shape:
            where = (origin or {}).get(name, path)
            raise ModelLoadError(
                where, f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}"
            )


def merge_ids(*groups: list[int]) -> list[int]:
    """Concatenate id lists, dropping repeats, keeping first-seen order."""
    return list(dict.fromkeys(i for group in groups for i in group))
