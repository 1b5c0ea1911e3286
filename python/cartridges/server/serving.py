"""The server's model, its engine, and the cartridges loaded into it (docs/api.md §3).

The model loads on a background thread so that the server answers at once (`/health` says
`unhealthy` until it is ready). Loaded cartridges live in the engine's cartridge cache, keyed
by their full id, under the memory budget: loading past it evicts the least recently used
cartridge that no running request holds. Every use goes through the store first, so a
caller reaches only its own cartridges and a deleted one is never served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from cartridges.cores import cpu_cores
from cartridges.model import resolve_device
from cartridges.models.default import base_model_id
from cartridges.server.passages import Passages
from cartridges.server.principal import Principal
from cartridges.server.errors import APIError
from cartridges.server.settings import Settings
from cartridges.store import core

log = logging.getLogger("cartridges.server")
MiB = 1 << 20


@dataclass(frozen=True)
class LoadedCartridge:
    id: str  # <owner>/<project>/<run_id>
    owner_id: int
    num_tokens: int
    loaded_at: int  # Unix seconds


class CartridgeUnavailable(Exception):
    """A cartridge that cannot be used now; `error` is what the client is answered."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Serving:
    def __init__(self, settings: Settings, store: Any, *, worker_threads: int, max_jobs: int) -> None:
        self.settings = settings
        self.store = store
        self.model_id = base_model_id(settings.model)
        self.device = resolve_device(settings.device)
        self.started_at = time.time()
        self.model: Any | None = None
        self.engine: Any | None = None
        self.load_error: str | None = None
        self._worker_threads = worker_threads
        self._max_jobs = max_jobs
        self._running_jobs = 0
        self._loaded: dict[str, LoadedCartridge] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # one load at a time per cartridge
        self.passages = Passages(store)  # retrieval in chat, over the cartridges' training files
        self._thread = threading.Thread(target=self._load_model, name="cartridges-model-load", daemon=True)

    # -- model and engine ------------------------------------------------------------------

    def start(self) -> None:
        """Starts loading the model. Call on the server's event loop: its engine hands its
        events to that loop directly (`Engine.deliver_on`)."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def _load_model(self) -> None:
        from cartridges.model import load_model

        try:
            started = time.monotonic()
            model = load_model(self.settings.model, device=self.device,
                               int8_activations=self.settings.int8_activations)
            self.engine = model.start_engine(
                kv_tokens=self.settings.kv_tokens,
                cartridge_cache_bytes=self.budget_bytes,
                num_threads=self.serve_threads(),
            )
            self.engine.deliver_on(self._loop)
            self.model = model
            log.info("model %s ready on %s in %.1f s", self.model_id, self.device, time.monotonic() - started)
        except Exception as error:  # the server keeps answering (files, datablocks) and says why
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("the model could not be loaded")

    @property
    def budget_bytes(self) -> int:
        return int(self.settings.cartridge_memory_mib * MiB)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.native.running

    @property
    def unready_reason(self) -> str | None:
        """Why chat cannot be served yet (None once ready)."""
        if self.ready:
            return None
        if self.load_error:
            return f"the model could not be loaded: {self.load_error}"
        return "the model is loading"

    def require_ready(self) -> tuple[Any, Any]:
        if not self.ready:
            if self.load_error:
                raise APIError(503, "The model could not be loaded; see the server log.")
            raise APIError(503, "The model is still loading; retry in a few seconds.", headers={"Retry-After": "5"})
        return self.model, self.engine

    def serve_threads(self) -> int:
        """The engine's share of the cores now: the setting, or every core minus those of the
        training workers that are running."""
        if self.settings.serve_threads:
            return self.settings.serve_threads
        return max(1, cpu_cores() - self._worker_threads * self._running_jobs)

    def training_jobs_changed(self, running: int) -> None:
        """From the job supervisor: `running` workers now compute beside the engine."""
        self._running_jobs = running
        if self.engine is not None and self.device == "cpu":
            self.engine.native.num_threads = self.serve_threads()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # -- cartridges ------------------------------------------------------------------------

    def cartridge(self, principal: Principal, identifier: str, *, param: str) -> tuple[Any, list[Any]]:
        """The caller's cartridge (full or bare run id): its datablock record and its KV prefixes
        (one, or one per part for a cartridge trained in parts), loaded if needed. Blocking: call
        from a worker thread. Raises CartridgeUnavailable."""
        model, engine = self.require_ready()
        record = self._record(principal, identifier, param)
        keys = cache_keys(record)
        prefixes = [engine.cartridges.get(key) for key in keys]
        if any(prefix is None for prefix in prefixes):
            with self._lock:
                loading = self._loading.setdefault(record.id, threading.Lock())
            with loading:  # a second caller waits for the first load instead of repeating it
                prefixes = [engine.cartridges.get(key) for key in keys]
                if any(prefix is None for prefix in prefixes):
                    prefixes = self._load(principal, record, model, engine, param)
        return record, prefixes

    def record(self, principal: Principal, identifier: str, *, param: str) -> Any:
        """The caller's trained cartridge's datablock record, its KV not loaded. Raises
        CartridgeUnavailable, as `cartridge` does."""
        self.require_ready()
        return self._record(principal, identifier, param)

    def _record(self, principal: Principal, identifier: str, param: str) -> Any:
        c = core()
        try:
            record = self.store.get_datablock(principal.owner, identifier)
        except c.NotFoundError:
            raise CartridgeUnavailable(APIError(404, f"No cartridge '{identifier}'.", code="model_not_found",
                                                param=param)) from None
        if record.status != "succeeded":
            raise CartridgeUnavailable(APIError(
                409, f"Cartridge '{identifier}' is not trained yet (status: {record.status}).",
                code="cartridge_not_ready", param=param))
        if record.model != self.model_id:
            raise CartridgeUnavailable(APIError(
                400, f"Cartridge '{identifier}' was trained for model '{record.model}'; this server runs "
                f"'{self.model_id}'.", code="model_mismatch", param=param))
        return record

    def _load(self, principal: Principal, record: Any, model: Any, engine: Any, param: str) -> list[Any]:
        from cartridges.cartridge import CartridgeFileError, load_cartridges

        c = core()
        try:
            path = self.store.datablock_cartridge_path(principal.owner, record.id)
            prefixes = [cartridge.prefix(model) for cartridge in load_cartridges(path, model)]
            if len(prefixes) != len(cache_keys(record)):
                raise CartridgeFileError(path, f"it holds {len(prefixes)} parts, its datablock "
                                         f"{len(cache_keys(record))}")
        except c.NotFoundError:  # deleted meanwhile
            raise CartridgeUnavailable(APIError(404, f"No cartridge '{record.id}'.", code="model_not_found",
                                                param=param)) from None
        except c.UnavailableError:
            raise  # the blob store away: a 503 (errors.py), not a damaged file
        except (CartridgeFileError, c.StoreError) as error:
            log.error("cartridge %s could not be read: %s", record.id, error)
            reason = error.reason if isinstance(error, CartridgeFileError) else "its file is damaged"
            raise CartridgeUnavailable(APIError(500, f"Cartridge '{record.id}' could not be read: {reason}.",
                                                code="cartridge_unreadable", param=param)) from None
        size = sum(prefix.nbytes for prefix in prefixes)
        budget = self.budget_bytes
        try:
            for key, prefix in zip(cache_keys(record), prefixes):
                engine.cartridges.put(key, prefix)
        except c.CacheFullError:
            self._uncache(record.id)
            if size > budget:
                raise CartridgeUnavailable(APIError(
                    400, f"Cartridge '{record.id}' ({size / MiB:.1f} MiB) is larger than the server's cartridge "
                    f"memory ({budget / MiB:.1f} MiB).", code="cartridge_too_large", param=param)) from None
            raise CartridgeUnavailable(APIError(
                429, "Cartridge memory is full of cartridges in use by running requests; retry shortly.",
                code="cartridge_memory_full", param=param, headers={"Retry-After": "1"})) from None
        loaded = LoadedCartridge(record.id, record.owner_id, record.num_tokens, int(time.time()))
        with self._lock:
            self._loaded[record.id] = loaded
        try:  # deleted while it loaded: never serve it
            self.store.get_datablock(principal.owner, record.id)
        except c.NotFoundError:
            self.unload(record.id)
            raise CartridgeUnavailable(APIError(404, f"No cartridge '{record.id}'.", code="model_not_found",
                                                param=param)) from None
        log.info("cartridge %s loaded (%d tokens%s, %.1f MiB)", record.id, record.num_tokens,
                 f" in {len(prefixes)} parts" if len(prefixes) > 1 else "", size / MiB)
        return prefixes

    def _uncache(self, cartridge_id: str) -> None:
        """Drops the cartridge's KV, every part of it, from the engine's cache."""
        for key in self.engine.cartridges.ids():
            if cached_cartridge_id(key) == cartridge_id:
                self.engine.cartridges.remove(key)

    def unload(self, cartridge_id: str) -> None:
        """Drops it from memory (requests running on it finish first)."""
        if self.engine is not None:
            self._uncache(cartridge_id)
        with self._lock:
            self._loaded.pop(cartridge_id, None)
            self._loading.pop(cartridge_id, None)

    def loaded(self, principal: Principal | None) -> list[LoadedCartridge]:
        """Loaded cartridges the caller may see (all for the admin, none for nobody), most
        recently used first."""
        if self.engine is None or principal is None:
            return []
        ids = list(dict.fromkeys(cached_cartridge_id(key) for key in self.engine.cartridges.ids()))
        with self._lock:
            for gone in set(self._loaded) - set(ids):  # evicted by the cache
                del self._loaded[gone]
            entries = [self._loaded[i] for i in ids if i in self._loaded]
        return [e for e in entries if principal.admin or e.owner_id == principal.user_id]


PART_KEY = "#part"  # the engine cache's key of part j of k of a cartridge: "<id>#partJofK"


def cache_keys(record: Any) -> list[str]:
    """The engine cache's keys of a datablock's KV: its id, or one key per part."""
    parts = (json.loads(record.metrics or "{}") or {}).get("parts") or []
    if len(parts) < 2:
        return [record.id]
    return [f"{record.id}{PART_KEY}{j}of{len(parts)}" for j in range(1, len(parts) + 1)]


def cached_cartridge_id(key: str) -> str:
    """The datablock id of an engine cache key."""
    return key.split(PART_KEY, 1)[0]


def loaded_cartridges(engine: Any) -> int:
    """How many cartridges the engine cache holds, a cartridge in parts once."""
    return len({cached_cartridge_id(key) for key in engine.cartridges.ids()})
