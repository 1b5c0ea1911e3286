"""Synthesis checkpoints: the conversations made so far, written atomically after each batch
so that a synthesis killed at any moment resumes from its last completed batch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

from .synthesize import Conversation

_FIELDS = [f.name for f in fields(Conversation)]


def save_conversations(path: str | os.PathLike[str], conversations: Sequence[Conversation]) -> None:
    """Written aside, fsynced, renamed: `path` always holds a whole checkpoint or none."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save([{name: getattr(c, name) for name in _FIELDS} for c in conversations], tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_conversations(path: str | os.PathLike[str]) -> list[Conversation]:
    return [Conversation(**row) for row in torch.load(path, weights_only=True)]
