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


# The environment variables that name the store's database and blob store (Settings.database_url
# and blob_url); training workers get them from their server this way, never on their command
# line (a URL may hold a password).
DATABASE_URL_ENV = "CARTRIDGES_DATABASE_URL"
BLOB_URL_ENV = "CARTRIDGES_BLOB_URL"


def open_store(data_dir: str | Path, *, sync: bool = True, database_url: str | None = None,
               blob_url: str | None = None, blob_mirror: Any | None = None) -> Any:
    """Opens (creating if needed) the store under data_dir: migrations applied, leftovers swept.
    Records live in SQLite under data_dir unless `database_url` names another database
    ("sqlite:///path.db", or "postgresql://user:password@host:port/db" shared by replicas);
    blobs live under data_dir unless `blob_url` names an object store ("s3://bucket/prefix") or
    a shared directory ("file:///path"), data_dir/blobs then being their local cache.
    `blob_mirror`: the mirror of `blob_url` opened already (`cartridges.blobs.open_blob_mirror`),
    for a caller that also reads through it."""
    if blob_mirror is None and blob_url:
        from .blobs import open_blob_mirror

        blob_mirror = open_blob_mirror(blob_url)
    return core().Store(str(Path(data_dir)), sync=sync, database_url=database_url or "", blob_mirror=blob_mirror)


def store_env(database_url: str | None, blob_url: str | None) -> dict[str, str]:
    """The environment that makes a child process (a training worker) open the same store."""
    return {DATABASE_URL_ENV: database_url or "", BLOB_URL_ENV: blob_url or ""}
