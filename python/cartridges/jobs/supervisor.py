"""The supervisor: runs in the server, starts one worker per job (`max_jobs` at a time,
oldest first), and keeps every datablock moving to an end. A worker is a process of this
server (the `local` backend) or a task on a Ray cluster (`ray`: ray_backend.py).

- A job left `running` by a server that died is started again and resumes from its
  checkpoints; after MAX_ATTEMPTS starts it ends `failed` with `interrupted` instead, so that
  a job that kills its worker every time cannot loop forever.
- A worker that dies while its job is live (crash, out of memory, kill -9) fails the job with
  `worker_crashed` and the reason; the next job starts. The server itself is never touched.
- A job deleted or cancelled while running stops itself within a heartbeat (it is told by the
  store); a worker that does not exit within CANCEL_GRACE_S is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ..cores import cpu_cores

from .progress import LEASE_S
from .worker import EXIT_BUSY, WORKER_DEVICE_ENV, claimant_id, job_is_locked

log = logging.getLogger("cartridges.jobs")

MAX_ATTEMPTS = 3
CANCEL_GRACE_S = 5.0
POLL_S = 0.5
# Live jobs looked at per status when choosing the next one (those another server's worker
# holds are passed over).
NEXT_JOB_WINDOW = 16
# How often the blob store is swept: checkpoints of jobs that ended without a worker, and objects
# no record names (uploads whose server died before recording them).
BLOB_STORE_SWEEP_S = 300.0
# How often the local cache of a blob store's blobs is brought within its budget.
CACHE_EVICT_S = 60.0


class WorkerHandle(Protocol):
    """A running worker as the supervisor sees it: a subprocess.Popen, or a ray_backend.RayTask."""

    pid: int | None

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...


@dataclass
class _Worker:
    proc: WorkerHandle
    log_path: Path
    stop_seen_at: float | None = None  # when the job was found deleted or ended
    started_at: float = field(default_factory=time.monotonic)


def default_worker_threads() -> int:
    """Half the cores (at least one): the other half stays with the server's engine."""
    return max(1, cpu_cores() // 2)


class Supervisor:
    def __init__(self, store: Any, data_dir: str | os.PathLike[str], *, max_jobs: int = 1,
                 worker_threads: int = 0, int8_activations: bool = True, poll_s: float = POLL_S,
                 store_env: Mapping[str, str] | None = None, backend: Literal["local", "ray"] = "local",
                 on_workers_changed: Callable[[int], None] | None = None, blob_mirror: Any = None,
                 worker_gpus: float = 0.0, blob_cache_bytes: int | None = None, worker_device: str = "cpu") -> None:
        """`store_env`: the environment that makes a worker open the same store (store.store_env).
        `blob_mirror`: the store's blob store (cartridges.blobs), where jobs keep checkpoints too;
        the supervisor removes those of jobs that ended while no worker ran them, and the objects
        that no record names.
        `worker_gpus`: the GPUs each Ray task asks for, on which it trains.
        `worker_device`: where the local backend's workers load the model, "cpu" or "cuda".
        `blob_cache_bytes`: with a blob mirror, the most the local copies in data_dir/blobs may
        take (cartridges.blobs.evict_cache, every CACHE_EVICT_S); None: no limit.
        `backend`: "local" runs each job in a worker process of this server, "ray" as a task on
        the Ray cluster of RAY_ADDRESS (ray_backend.py).
        `on_workers_changed(n)` is called from the supervisor thread whenever the number of
        running workers changes (the server gives the engine's cores back and forth with it)."""
        from ..store import core

        self._core = core()
        self._admin = self._core.Owner(0, True)
        self._store = store
        self._data_dir = str(data_dir)
        self._store_env = dict(store_env or {})
        self.backend = backend
        self._claimant = claimant_id(self._data_dir)
        self.max_jobs = max(1, max_jobs)
        self.worker_threads = worker_threads or default_worker_threads()
        self.worker_gpus = worker_gpus
        self.worker_device = worker_device
        self.int8_activations = int8_activations
        self._poll_s = poll_s
        self.on_workers_changed = on_workers_changed
        self._blob_mirror = blob_mirror
        self._swept_at = -BLOB_STORE_SWEEP_S
        self._blob_cache_bytes = blob_cache_bytes if blob_mirror is not None else None
        self._evicted_at = -CACHE_EVICT_S
        self._workers: dict[str, _Worker] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-supervisor", daemon=True)

    def start(self) -> None:
        if self.backend == "ray":
            from .ray_backend import connect

            connect()
        self._thread.start()

    def wake(self) -> None:
        """Look at the store now (a job was queued or deleted) rather than at the next poll."""
        self._wake.set()

    def stop(self) -> None:
        """Stops the workers; their jobs stay `running` and resume at the next start."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        for worker in self._workers.values():
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait()
        self._workers.clear()

    def worker_pids(self) -> dict[str, int]:
        """The local worker processes by job (a Ray task has none in this server)."""
        return {run_id: w.proc.pid for run_id, w in list(self._workers.items()) if w.proc.pid is not None}

    @property
    def running_jobs(self) -> int:
        return len(self._workers)

    def _loop(self) -> None:
        reported = 0
        while not self._stopping.is_set():
            try:
                self._reap()
                self._stop_abandoned()
                self._launch()
                self._sweep_blob_store()
                self._evict_blob_cache()
                if self.on_workers_changed is not None and len(self._workers) != reported:
                    reported = len(self._workers)
                    self.on_workers_changed(reported)
            except Exception:  # the supervisor must outlive any one bad row or transient error
                log.exception("job supervisor")
            self._wake.wait(self._poll_s)
            self._wake.clear()

    def _sweep_blob_store(self) -> None:
        if self._blob_mirror is None or time.monotonic() - self._swept_at < BLOB_STORE_SWEEP_S:
            return
        self._swept_at = time.monotonic()
        from ..blobs import sweep_orphans
        from .checkpoints import sweep

        removed = sweep(self._blob_mirror, self._store, self._core)
        if removed:
            log.info("removed the blob store's checkpoints of %d ended jobs", removed)
        orphans = sweep_orphans(self._blob_mirror, self._store)
        if orphans:
            log.info("removed %d objects of the blob store that no record names", orphans)

    def _evict_blob_cache(self) -> None:
        if self._blob_cache_bytes is None or time.monotonic() - self._evicted_at < CACHE_EVICT_S:
            return
        self._evicted_at = time.monotonic()
        from ..blobs import evict_cache

        freed = evict_cache(Path(self._data_dir) / "blobs", self._blob_cache_bytes)
        if freed:
            log.info("evicted %.1f MiB of local blob copies", freed / (1 << 20))

    def _record(self, run_id: str) -> Any | None:
        try:
            return self._store.get_datablock(self._admin, run_id)
        except self._core.NotFoundError:
            return None

    def _reap(self) -> None:
        for run_id, worker in list(self._workers.items()):
            code = worker.proc.poll()
            if code is None or self._stopping.is_set():
                continue
            del self._workers[run_id]
            record = self._record(run_id)
            if record is None or record.status not in ("queued", "running") or code == EXIT_BUSY:
                continue
            reason = _describe_exit(code)
            last = _last_line(worker.log_path)
            message = f"the training worker {reason}" + (f"; last output: {last}" if last else "")
            log.error("job %s: %s", run_id, message)
            self._fail(run_id, "worker_crashed", message)

    def _stop_abandoned(self) -> None:
        now = time.monotonic()
        for run_id, worker in list(self._workers.items()):
            record = self._record(run_id)
            if record is not None and record.status in ("queued", "running"):
                continue
            if worker.stop_seen_at is None:
                worker.stop_seen_at = now  # it will notice through its heartbeat
            elif now - worker.stop_seen_at > CANCEL_GRACE_S and worker.proc.poll() is None:
                log.warning("job %s: worker did not stop after cancellation; killing it", run_id)
                worker.proc.kill()

    def _launch(self) -> None:
        while len(self._workers) < self.max_jobs and not self._stopping.is_set():
            record = self._next_job()
            if record is None:
                return
            if record.status == "running" and record.attempts >= MAX_ATTEMPTS:
                self._fail(record.run_id, "interrupted",
                           f"the job was interrupted {record.attempts} times and is not resumed again")
                continue
            self._start_worker(record.run_id)

    def _next_job(self) -> Any | None:
        """Interrupted jobs first (they hold checkpoints), then the oldest queued one; never a
        job whose worker runs, here or in another server sharing the store."""
        for status in ("running", "queued"):
            page = self._store.list_datablocks(self._admin, status=status, descending=False,
                                               limit=len(self._workers) + NEXT_JOB_WINDOW)
            for record in page.data:
                if record.run_id not in self._workers and not self._held_elsewhere(record):
                    return record
        return None

    def _held_elsewhere(self, record: Any) -> bool:
        """A worker runs it: one of this data directory (its lock file is taken), or one of
        another server sharing the store (it claimed the job and its heartbeat is fresh)."""
        if record.claimant not in ("", self._claimant) and time.time() - record.updated_at < LEASE_S:
            return True
        try:
            return job_is_locked(self._store.job_dir(self._admin, record.run_id))
        except (self._core.NotFoundError, self._core.ConflictError):
            return True  # deleted or ended meanwhile: nothing to start

    def worker_settings(self) -> dict[str, str]:
        """The environment a worker gets from this server (cartridges.jobs.worker's doc): its
        threads, arithmetic and store, and for a local worker its device (a Ray task trains on
        the GPUs Ray gives it)."""
        settings = {"CARTRIDGES_WORKER_THREADS": str(self.worker_threads),
                    "CARTRIDGES_INT8_ACTIVATIONS": "1" if self.int8_activations else "0", **self._store_env}
        if self.backend == "local":
            settings[WORKER_DEVICE_ENV] = self.worker_device
        return settings

    def _start_worker(self, run_id: str) -> None:
        try:
            log_path = Path(self._store.job_dir(self._admin, run_id)) / "worker.log"
        except (self._core.NotFoundError, self._core.ConflictError):
            return  # deleted or ended meanwhile
        settings = self.worker_settings()
        if self.backend == "ray":
            from .ray_backend import RayTask

            self._workers[run_id] = _Worker(
                RayTask(run_id, self._data_dir, settings, self.worker_threads, MAX_ATTEMPTS, self.worker_gpus),
                log_path)
            log.info("job %s: submitted to the Ray cluster", run_id)
            return
        env = dict(os.environ, **settings)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cartridges.jobs.worker", run_id, self._data_dir],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        self._workers[run_id] = _Worker(proc, log_path)
        log.info("job %s: worker %d started", run_id, proc.pid)

    def _fail(self, run_id: str, code: str, message: str) -> None:
        try:
            self._store.fail_datablock(self._admin, run_id, code, message)
        except (self._core.NotFoundError, self._core.ConflictError):
            pass


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (out of memory, or killed)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code} before finishing the job"


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 2000))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
