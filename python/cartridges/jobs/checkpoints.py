"""A training job's checkpoints in the blob store (CARTRIDGES_BLOB_URL), so that a job taken over
by another machine resumes where it stopped rather than from its first step.

The worker writes its checkpoints into the job's scratch directory as always (each file written
aside and renamed whole); `CheckpointSync` copies every file that changed there to the blob store
as jobs/<run_id>/<name>, at most every SYNC_INTERVAL_S per file and once more when the job stops,
and a worker starting the job brings them back first (`restore`). The blob store's copies are
removed when the job ends, and `sweep` removes those of jobs deleted or cancelled while no worker
ran them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("cartridges.jobs")

PREFIX = "jobs/"
POLL_S = 2.0
# A file rewritten more often than this (synthesis' conversations after every batch) is copied
# at this pace: a takeover loses at most this much of the work since.
SYNC_INTERVAL_S = 15.0


def job_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}/"


def _checkpoint_files(scratch: Path) -> list[Path]:
    """The scratch directory's whole checkpoint files: not the lock, not a file being written,
    not the worker's log."""
    if not scratch.is_dir():
        return []
    return [p for p in scratch.iterdir()
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith((".tmp", ".log"))]


class CheckpointSync:
    """Copies a job's checkpoint files between its scratch directory and the blob store."""

    def __init__(self, mirror: Any, run_id: str, scratch: str | os.PathLike[str],
                 poll_s: float = POLL_S, interval_s: float = SYNC_INTERVAL_S) -> None:
        self._mirror, self._prefix, self._scratch = mirror, job_prefix(run_id), Path(scratch)
        self._poll_s, self._interval_s = poll_s, interval_s
        self._copied: dict[str, tuple[int, int]] = {}  # name -> (mtime_ns, size) last copied
        self._copied_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def restore(self) -> list[str]:
        """Brings the blob store's checkpoints of the job into the scratch directory, over any
        local ones (the blob store has the latest: whichever machine ran the job last wrote
        there); returns the names brought."""
        brought = []
        for name in self._mirror.names(self._prefix):
            local = self._scratch / name[len(self._prefix):]
            tmp = local.with_name(local.name + ".restore.tmp")
            if self._mirror.download(name, str(tmp)):
                os.replace(tmp, local)
                stat = local.stat()
                self._copied[local.name] = (stat.st_mtime_ns, stat.st_size)
                brought.append(local.name)
        if brought:
            log.info("restored checkpoints %s from the blob store", ", ".join(sorted(brought)))
        return brought

    def sync(self, force: bool = False) -> None:
        """Copies each checkpoint file that changed since its last copy (`force`: whatever the
        interval), oldest first, so that a file that depends on one written before it (the
        training state on the synthesized data) does not reach the blob store ahead of it."""
        now = time.monotonic()
        written = []
        for path in _checkpoint_files(self._scratch):
            try:
                written.append((path.stat(), path))
            except FileNotFoundError:
                continue  # replaced meanwhile: the next round copies the new one
        for stat, path in sorted(written, key=lambda entry: entry[0].st_mtime_ns):
            version = (stat.st_mtime_ns, stat.st_size)
            if self._copied.get(path.name) == version:
                continue
            if not force and now - self._copied_at.get(path.name, -self._interval_s) < self._interval_s:
                continue
            self._mirror.upload(self._prefix + path.name, str(path))
            self._copied[path.name], self._copied_at[path.name] = version, now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="checkpoint-sync", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.sync()
            except Exception as error:  # the blob store away for a while: the next round retries
                log.warning("checkpoints not copied to the blob store: %s", error)

    def stop(self) -> None:
        """Stops copying, after a last copy of what changed (the job stopped, to resume elsewhere)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sync(force=True)
        except Exception as error:
            log.warning("checkpoints not copied to the blob store: %s", error)

    def clear(self) -> None:
        """Removes the job's checkpoints from the blob store (the job ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        remove(self._mirror, self._prefix)


def remove(mirror: Any, prefix: str) -> None:
    for name in mirror.names(prefix):
        mirror.remove(name)


def sweep(mirror: Any, store: Any, core: Any) -> int:
    """Removes the blob store's checkpoints of jobs that are no longer queued or running (deleted,
    cancelled or ended while no worker held them); returns how many jobs'."""
    admin = core.Owner(0, True)
    run_ids = {name[len(PREFIX):].split("/", 1)[0] for name in mirror.names(PREFIX)}
    removed = 0
    for run_id in sorted(run_ids):
        try:
            live = store.get_datablock(admin, run_id).status in ("queued", "running")
        except core.NotFoundError:
            live = False
        if not live:
            remove(mirror, job_prefix(run_id))
            removed += 1
    return removed
