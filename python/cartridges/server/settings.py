"""Server settings: command-line values over environment variables over defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

MiB = 1 << 20
# docs/api.md §5: the largest file an upload may carry.
MAX_UPLOAD_BYTES = 512 * MiB

# Field name → environment variable.
ENV_VARS = {
    "host": "CARTRIDGES_HOST",
    "port": "CARTRIDGES_PORT",
    "data_dir": "CARTRIDGES_DATA_DIR",
    "model": "CARTRIDGES_MODEL",
    "max_upload_bytes": "CARTRIDGES_MAX_UPLOAD_BYTES",
    "api_key": "CARTRIDGES_API_KEY",
    "admin_key": "CARTRIDGES_ADMIN_KEY",
    "max_jobs": "CARTRIDGES_MAX_JOBS",
    "worker_threads": "CARTRIDGES_WORKER_THREADS",
    "device": "CARTRIDGES_DEVICE",
    "kv_tokens": "CARTRIDGES_KV_TOKENS",
    "cartridge_memory_mib": "CARTRIDGES_CARTRIDGE_MEMORY_MIB",
    "serve_threads": "CARTRIDGES_SERVE_THREADS",
    "default_max_tokens": "CARTRIDGES_DEFAULT_MAX_TOKENS",
    "int8_activations": "CARTRIDGES_INT8_ACTIVATIONS",
}
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = 8000
    """TCP port to listen on."""
    data_dir: Path = Path("cartridges-data")
    """Directory of the store (SQLite database and blobs); created if missing."""
    model: str | None = None
    """Base model: a Hugging Face directory or a GGUF file; None is the embedded default model."""
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    """Largest accepted file; a larger upload is refused with 413 while it streams in."""
    api_key: str | None = None
    """Key given to user `default` when the store has no users yet (else a fresh one is printed)."""
    admin_key: str | None = None
    """A key that may act on every user's objects; None disables it."""
    store_sync: bool = True
    """fsync blobs and directories (off only for throwaway stores in benchmarks)."""
    max_jobs: int = 1
    """Training jobs run at once, each in its own worker process."""
    worker_threads: int = 0
    """Intra-op threads of each training worker; 0: half the cores, the rest left to serving."""
    device: str = "auto"
    """Where the model runs: auto (cuda when available), cpu or cuda."""
    kv_tokens: int = 32768
    """KV pool of the serving engine in tokens, shared by every running request's own tokens
    (prompt and reply; cartridges are apart). Allocated empty: untouched pages cost nothing."""
    cartridge_memory_mib: float = 1024
    """Memory budget of loaded cartridges; loading past it evicts the least recently used idle one."""
    serve_threads: int = 0
    """Intra-op threads of the serving engine; 0: every core while no training job runs, the
    cores the workers do not take while they do."""
    default_max_tokens: int = 1024
    """Reply length when a chat request gives no max_tokens (cut to what the context leaves)."""
    int8_activations: bool = True
    """On CPU with a GGUF's quantized weights, round activations to 8 bits as llama.cpp does
    (about 2x faster decode); false keeps float32 activations (transformers' results)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Defaults, then CARTRIDGES_* variables, then the overrides that are not None."""
        environ = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for name, var in ENV_VARS.items():
            raw = environ.get(var)
            if raw is not None and raw != "":
                values[name] = _convert(name, types[name], raw, var)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "data_dir" in values:
            values["data_dir"] = Path(values["data_dir"])  # type: ignore[arg-type]
        settings = replace(cls(), **values)
        if settings.max_upload_bytes < 1:
            raise ValueError("max_upload_bytes must be positive")
        if settings.max_jobs < 1 or settings.worker_threads < 0 or settings.serve_threads < 0:
            raise ValueError("max_jobs must be positive, worker_threads and serve_threads not negative")
        if settings.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {settings.device!r}")
        if settings.kv_tokens < 1 or settings.cartridge_memory_mib <= 0 or settings.default_max_tokens < 1:
            raise ValueError("kv_tokens, cartridge_memory_mib and default_max_tokens must be positive")
        return settings


def _convert(name: str, type_name: object, raw: str, var: str) -> object:
    if type_name == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{var} must be a number, got {raw!r}") from None
    if type_name == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{var} must be true or false (1/0), got {raw!r}")
    if type_name == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer, got {raw!r}") from None
    return raw
