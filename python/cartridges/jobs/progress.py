"""What a running job tells the store: progress (stage, completed, total, estimated seconds
left in the stage) and metrics, written on change at most once a second and by a heartbeat
every few seconds, so that a datablock's progress is never more than a few seconds old."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

HEARTBEAT_S = 2.0
# A running job whose last write is older than this has lost its worker: another server
# sharing the store may resume it (Store.start_datablock's lease_s).
LEASE_S = 8 * HEARTBEAT_S
MIN_WRITE_INTERVAL_S = 1.0


def empty_metrics() -> dict[str, Any]:
    return {"loss": None, "synthetic_samples": None, "train_tokens": None, "quality": None, "signal_by_part": None,
            "parts": None}


class JobProgress:
    """Progress of one job. `stopped` turns true (and `cancel` is cancelled) as soon as the
    store refuses a write: the datablock was deleted or cancelled, and the job must stop."""

    def __init__(self, store: Any, owner: Any, run_id: str, cancel: Any, errors: Any) -> None:
        self._store = store
        self._owner = owner
        self._run_id = run_id
        self._cancel = cancel
        self._errors = errors  # the core module: NotFoundError, ConflictError
        self._lock = threading.Lock()
        self.stage = "queued"
        self.completed = 0
        self.total = 0
        self.part: tuple[int, int] | None = None  # (part, parts) for a datablock trained in parts
        self._part_changed = False
        self.metrics = empty_metrics()
        self._stage_start: tuple[float, int] = (time.monotonic(), 0)
        self._last_write = 0.0
        self.stopped = False
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="job-heartbeat", daemon=True)

    def start(self) -> None:
        self._heartbeat.start()

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join()

    def set_part(self, part: int, parts: int) -> None:
        """The stages that follow are part `part` of `parts`'s (each part goes through them)."""
        with self._lock:
            self.part, self._part_changed = (part, parts), True

    def update(self, stage: str, completed: int, total: int, **metrics: Any) -> None:
        with self._lock:
            changed = stage != self.stage or self._part_changed
            self._part_changed = False
            if changed:
                self._stage_start = (time.monotonic(), completed)
            self.stage, self.completed, self.total = stage, completed, total
            self.metrics.update({k: v for k, v in metrics.items() if v is not None})
            if changed or time.monotonic() - self._last_write >= MIN_WRITE_INTERVAL_S:
                self._write_locked()

    def progress(self) -> dict[str, Any]:
        part = {} if self.part is None else {"part": self.part[0], "parts": self.part[1]}
        return {"stage": self.stage, "completed": self.completed, "total": self.total,
                "eta_seconds": self._eta(), **part}

    def _eta(self) -> int | None:
        """Seconds left in this stage, at the rate since the stage started (or resumed)."""
        started, start_count = self._stage_start
        done = self.completed - start_count
        if done <= 0 or self.total <= 0:
            return None
        return round((time.monotonic() - started) / done * (self.total - self.completed))

    def _write_locked(self) -> None:
        if self.stopped:
            return
        try:
            self._store.update_datablock_progress(
                self._owner, self._run_id, json.dumps(self.progress()), json.dumps(self.metrics)
            )
        except (self._errors.NotFoundError, self._errors.ConflictError):
            self.stopped = True
            self._cancel.cancel()
        self._last_write = time.monotonic()

    def _beat(self) -> None:
        while not self._heartbeat_stop.wait(HEARTBEAT_S):
            with self._lock:
                self._write_locked()
