"""Synthesis checkpoints: the conversations made so far, a record appended and fsynced after
each batch, so that a synthesis killed at any moment resumes from its last completed batch.

Appending keeps each batch's cost flat: rewriting every conversation so far after each batch
made a long corpus' synthesis quadratic (the 53K-token chronicle's 5,392 conversations: about
180 MB rewritten and fsynced per batch at the end). The file is a magic line, then records of
an 8-byte little-endian length and a `torch.save` of one batch's conversations. A record cut
short by a crash is dropped when the file is opened again, and cut off it; a whole record that
cannot be read is a clear error that names the file. A file in the former layout (one
`torch.save` of the whole list) is read as it is and rewritten in this one."""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

from .synthesize import Conversation

_FIELDS = [f.name for f in fields(Conversation)]
MAGIC = b"cartridges-conversations-1\n"
_LENGTH = struct.Struct("<Q")


def _record(conversations: Sequence[Conversation]) -> bytes:
    buffer = io.BytesIO()
    torch.save([{name: getattr(c, name) for name in _FIELDS} for c in conversations], buffer)
    return _LENGTH.pack(len(buffer.getvalue())) + buffer.getvalue()


def _former_layout(data: bytes) -> bool:
    return data.startswith(b"PK")  # a torch.save zip of the whole list


def _load(blob: bytes, path: Path, offset: int) -> list[Conversation]:
    """The conversations of one whole record (or of a file in the former layout) at `offset`."""
    try:
        return [Conversation(**row) for row in torch.load(io.BytesIO(blob), weights_only=True)]
    except Exception as error:  # damaged on disk; torch's own message names neither the file nor the way out
        raise ValueError(f"{path} is damaged: the record at byte {offset} cannot be read; delete the file "
                         "to synthesize again") from error


def _read(data: bytes, path: Path) -> tuple[list[Conversation], int]:
    """The conversations of `data` (the bytes of `path`), and the bytes its whole records end at:
    a record cut short at the end is left out. The former layout is read whole."""
    if _former_layout(data):
        return _load(data, path, 0), len(data)
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a synthesis checkpoint: delete it to synthesize again")
    conversations, end = [], len(MAGIC)
    while end + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, end)
        blob = data[end + _LENGTH.size : end + _LENGTH.size + length]
        if len(blob) < length:
            break  # the record a crash cut short
        conversations.extend(_load(blob, path, end))
        end += _LENGTH.size + length
    return conversations, end


def load_conversations(path: str | os.PathLike[str]) -> list[Conversation]:
    """Every conversation of the whole records of the checkpoint `path`, in the order made."""
    path = Path(path)
    return _read(path.read_bytes(), path)[0]


def _write_new(path: Path, conversations: Sequence[Conversation]) -> None:
    """`path` as a checkpoint of `conversations` (one record, none when empty), written aside,
    fsynced and renamed: it holds a whole checkpoint or the one it had."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + (_record(conversations) if conversations else b""))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ConversationLog:
    """A synthesis checkpoint open for appending. With `resume`, it keeps what `path` holds
    (`conversations`, read once); without, or when there is no file, it starts empty."""

    def __init__(self, path: str | os.PathLike[str], resume: bool) -> None:
        self.path = Path(path)
        self.conversations: list[Conversation] = []
        if resume and self.path.exists():
            data = self.path.read_bytes()
            self.conversations, end = _read(data, self.path)
            if _former_layout(data):
                _write_new(self.path, self.conversations)  # rewritten in this layout
            elif end < len(data):
                os.truncate(self.path, end)  # the torn record, cut off before appending
        else:
            _write_new(self.path, [])
        self.count = len(self.conversations)

    def append(self, conversations: Sequence[Conversation]) -> None:
        """Appends one batch as a record and fsyncs it."""
        with open(self.path, "ab") as f:
            f.write(_record(conversations))
            f.flush()
            os.fsync(f.fileno())
        self.count += len(conversations)
