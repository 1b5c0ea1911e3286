"""Server settings: command-line values over environment variables over defaults."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..store import BLOB_URL_ENV, DATABASE_URL_ENV

MiB = 1 << 20
# docs/api.md §5: the largest file an upload may carry.
MAX_UPLOAD_BYTES = 512 * MiB
# docs/api.md §1: the largest body of any other request (a chat, a training request).
MAX_REQUEST_BYTES = 32 * MiB

# Field name → environment variable.
ENV_VARS = {
    "host": "CARTRIDGES_HOST",
    "port": "CARTRIDGES_PORT",
    "data_dir": "CARTRIDGES_DATA_DIR",
    "database_url": DATABASE_URL_ENV,
    "blob_url": BLOB_URL_ENV,
    "model": "CARTRIDGES_MODEL",
    "max_upload_bytes": "CARTRIDGES_MAX_UPLOAD_BYTES",
    "max_request_bytes": "CARTRIDGES_MAX_REQUEST_BYTES",
    "api_key": "CARTRIDGES_API_KEY",
    "admin_key": "CARTRIDGES_ADMIN_KEY",
    "max_jobs": "CARTRIDGES_MAX_JOBS",
    "job_backend": "CARTRIDGES_JOB_BACKEND",
    "worker_threads": "CARTRIDGES_WORKER_THREADS",
    "worker_gpus": "CARTRIDGES_WORKER_GPUS",
    "device": "CARTRIDGES_DEVICE",
    "training_device": "CARTRIDGES_TRAINING_DEVICE",
    "kv_tokens": "CARTRIDGES_KV_TOKENS",
    "cartridge_memory_mib": "CARTRIDGES_CARTRIDGE_MEMORY_MIB",
    "blob_cache_mib": "CARTRIDGES_BLOB_CACHE_MIB",
    "serve_threads": "CARTRIDGES_SERVE_THREADS",
    "default_max_tokens": "CARTRIDGES_DEFAULT_MAX_TOKENS",
    "int8_activations": "CARTRIDGES_INT8_ACTIVATIONS",
}


class Settings(BaseModel):
    """Every server setting (docs/configuration.md). Constructed directly, values must have
    their field's type; `from_env` parses environment variables' strings."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port to listen on."""
    data_dir: Path = Field(Path("cartridges-data"), strict=False)  # a str is a path too
    """Directory of the store (SQLite database and blobs); created if missing."""
    database_url: str | None = Field(None, pattern=r"^(sqlite:///|postgres(ql)?://).+")
    """Where the store's records live: None keeps SQLite in data_dir; sqlite:///path.db names
    another SQLite file; postgresql://user:password@host:port/db a PostgreSQL database that
    several servers share."""
    blob_url: str | None = Field(None, pattern=r"^(s3://[^/]+(/.*)?|file:///.+)$")
    """Where blobs (uploaded files, cartridges) live: None keeps them in data_dir; s3://bucket/prefix
    an S3-compatible object store (AWS_ENDPOINT_URL and the other AWS_* variables); file:///path a
    directory every replica mounts (NFS, a shared volume). With either, data_dir/blobs is a local
    cache and downloads stream out of the blob store."""
    blob_cache_mib: float = Field(10240, gt=0)
    """With blob_url, the most the local copies in data_dir/blobs may take: every minute the
    copies written or fetched longest ago are removed until the rest fit (a later use fetches
    them again). Without blob_url it does nothing: data_dir/blobs then holds the only copies."""
    model: str | None = None
    """Base model: a Hugging Face directory or a GGUF file; None is the embedded default model."""
    max_upload_bytes: int = Field(MAX_UPLOAD_BYTES, ge=1)
    """Largest accepted file; a larger upload is refused with 413 while it streams in."""
    max_request_bytes: int = Field(MAX_REQUEST_BYTES, ge=1)
    """Largest body of any other request (a chat, a training request); a larger one is refused
    with 413 before it is parsed, with or without an API key."""
    api_key: str | None = None
    """Key given to user `default` when the store has no users yet (else a fresh one is printed)."""
    admin_key: str | None = None
    """A key that may act on every user's objects; None disables it."""
    store_sync: bool = True
    """fsync blobs and directories (off only for throwaway stores in benchmarks)."""
    max_jobs: int = Field(1, ge=1)
    """Training jobs run at once, each in its own worker process."""
    job_backend: Literal["local", "ray"] = "local"
    """Where training jobs run: local worker processes of this server, or tasks on the Ray
    cluster of RAY_ADDRESS (a local cluster started in the server when it is unset)."""
    worker_threads: int = Field(0, ge=0)
    """Intra-op threads of each training worker; 0: half the cores, the rest left to serving."""
    worker_gpus: float = Field(0.0, ge=0.0)
    """GPUs each training job asks of the Ray cluster (job_backend "ray"; a fraction shares one);
    0: none, the job trains on CPUs. A task given a GPU trains on CUDA; the local backend's
    workers train on `training_device`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: auto (cuda when available), cpu or cuda."""
    training_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the local backend's training workers load the model: auto (where the server's
    model runs, `device`), cpu or cuda."""
    kv_tokens: int = Field(32768, ge=1)
    """KV pool of the serving engine in tokens, shared by every running request's own tokens
    (prompt and reply; cartridges are apart). Allocated empty: untouched pages cost nothing."""
    cartridge_memory_mib: float = Field(1024, gt=0)
    """Memory budget of loaded cartridges; loading past it evicts the least recently used idle one."""
    serve_threads: int = Field(0, ge=0)
    """Intra-op threads of the serving engine; 0: every core while no training job runs, the
    cores the workers do not take while they do."""
    default_max_tokens: int = Field(1024, ge=1)
    """Reply length when a chat request gives no max_tokens (cut to what the context leaves)."""
    int8_activations: bool = True
    """On CPU with a GGUF's quantized weights, round activations to 8 bits as llama.cpp does
    (about 2x faster decode); false keeps float32 activations (transformers' results)."""

    @field_validator("database_url")
    @classmethod
    def _database_url_parses(cls, url: str | None) -> str | None:
        """A URL whose host or port cannot be read is refused here, with the rest of the settings,
        rather than when the store opens (the password never appears in the message)."""
        if url and not url.startswith("sqlite:"):
            try:
                urlsplit(url).port  # noqa: B018  (reading it checks it)
            except ValueError as error:
                raise ValueError(f"not a PostgreSQL URL postgresql://user:password@host:port/db ({error})") from None
        return url

    @field_validator("blob_url")
    @classmethod
    def _blob_url_parses(cls, url: str | None) -> str | None:
        if url:
            from cartridges.blobs import parse_blob_url, parse_directory_url

            parse_directory_url(url) if url.startswith("file:") else parse_blob_url(url)
        return url

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Defaults, then CARTRIDGES_* variables, then the overrides that are not None.
        A variable that does not parse as its setting's type, or a value out of range, is a
        ValueError that names the variable."""
        environ = os.environ if environ is None else environ
        raw = {name: environ[var] for name, var in ENV_VARS.items() if environ.get(var)}
        try:
            # Strings as the types they stand for ("8000", "0", "true"): lax, not strict.
            from_env = cls.model_validate(raw, strict=False).model_dump(include=set(raw))
        except ValidationError as error:
            raise ValueError(_described(error, ENV_VARS)) from None
        values = {**from_env, **{k: v for k, v in overrides.items() if v is not None}}
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ValueError(_described(error, {})) from None

    def worker_device(self) -> str:
        """Where local training workers load the model: `training_device` decided, "auto"
        being where the server's model runs."""
        from cartridges.model import resolve_device

        return resolve_device(self.device if self.training_device == "auto" else self.training_device)


def _described(error: ValidationError, names: Mapping[str, str]) -> str:
    """The first problem of a settings error, naming the variable (or setting) it came from."""
    problem = error.errors()[0]
    field = str(problem["loc"][0]) if problem["loc"] else ""
    given = problem.get("input")
    if isinstance(given, str):
        given = re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", given)  # never a URL's password
    value = f", got {given!r}" if isinstance(given, (str, int, float)) else ""
    return f"{names.get(field, field)}: {problem['msg'].removeprefix('Value error, ')}{value}"
