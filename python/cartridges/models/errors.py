"""The one error type of the model loading layer."""

from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A model file or directory that cannot be loaded, and why.

    `path` names the exact file at fault (not only the model directory), so that the
    message points the user at what to fix or download again.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load model from {self.path}: {reason}")
