"""Opening the C++ store (`cartridges_core.Store`) from Python: one way for the server, its
training jobs and the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def core() -> Any:
    """The compiled module; torch must be imported first (it brings libtorch)."""
    import torch  # noqa: F401

    import cartridges_core

    return cartridges_core


def open_store(data_dir: str | Path, *, sync: bool = True) -> Any:
    """Opens (creating if needed) the store under data_dir: migrations applied, leftovers swept."""
    return core().Store(str(Path(data_dir)), sync=sync)
