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


# The environment variable that names the store's database (Settings.database_url); training
# workers get it from their server this way, never on their command line (it may hold a password).
DATABASE_URL_ENV = "CARTRIDGES_DATABASE_URL"


def open_store(data_dir: str | Path, *, sync: bool = True, database_url: str | None = None) -> Any:
    """Opens (creating if needed) the store under data_dir: migrations applied, leftovers swept.
    Records live in SQLite under data_dir unless `database_url` names another database
    ("sqlite:///path.db", or "postgresql://user:password@host:port/db" shared by replicas)."""
    return core().Store(str(Path(data_dir)), sync=sync, database_url=database_url or "")
