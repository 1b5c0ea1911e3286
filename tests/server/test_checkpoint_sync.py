"""A training job's checkpoints in the blob store (cartridges.jobs.checkpoints): copied as they
change, brought back by the next worker, removed when the job ends; a job whose machine died
is resumed by another machine from those checkpoints, to the very cartridge of an
uninterrupted run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cartridges import Cartridge
from cartridges.blobs import DirectoryBlobs, open_blob_mirror
from cartridges.jobs.checkpoints import CheckpointSync, sweep
from cartridges.jobs.worker import run_job
from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV, core, open_store

from .test_datablocks_jobs import SLOW_CONFIG, SLOW_JOBS
from .test_datablocks_worker import queue_job


def test_checkpoints_are_copied_as_they_change_brought_back_and_removed(tmp_path: Path, shared_blob_url: str) -> None:
    mirror = open_blob_mirror(shared_blob_url)

    def stored() -> bytes:
        mirror.download("jobs/run1/train.ckpt", str(tmp_path / "copy"))
        return (tmp_path / "copy").read_bytes()

    scratch = tmp_path / "machine-a"
    scratch.mkdir()
    (scratch / "train.ckpt").write_bytes(b"step 2")
    (scratch / ".lock").write_bytes(b"")
    (scratch / "train.ckpt.tmp").write_bytes(b"half written")
    (scratch / "worker.log").write_bytes(b"the worker's own output")
    sync = CheckpointSync(mirror, "run1", scratch, interval_s=3600)
    sync.sync()
    assert mirror.names("jobs/run1/") == ["jobs/run1/train.ckpt"]  # whole files only

    (scratch / "train.ckpt").write_bytes(b"step 4, written again")
    sync.sync()  # within the interval: not copied again yet
    assert stored() == b"step 2"
    sync.stop()  # the job stops: what changed is copied whatever the interval
    assert stored() == b"step 4, written again"

    other = tmp_path / "machine-b"
    other.mkdir()
    (other / "train.ckpt").write_bytes(b"a stale step 0 from an earlier attempt")
    assert CheckpointSync(mirror, "run1", other).restore() == ["train.ckpt"]
    assert (other / "train.ckpt").read_bytes() == b"step 4, written again"
    assert sorted(p.name for p in other.iterdir()) == ["train.ckpt"]

    CheckpointSync(mirror, "run1", other).clear()
    assert mirror.names("jobs/") == []


def test_checkpoints_are_copied_in_the_order_they_were_written(tmp_path: Path) -> None:
    # The training state refers to the synthesized data: a machine that dies between two
    # uploads must not leave the state in the blob store without the data it was written after.
    class RecordingBlobs(DirectoryBlobs):
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.uploaded: list[str] = []

        def upload(self, name: str, path: str) -> None:
            self.uploaded.append(name)
            super().upload(name, path)

    mirror = RecordingBlobs((tmp_path / "blobs").as_uri())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    names = ["train.ckpt.data.pt", "train.ckpt", "train.ckpt.init.pt"]  # not in name order
    for age, name in enumerate(reversed(names)):
        path = scratch / name
        path.write_bytes(name.encode())
        os.utime(path, ns=(1_000_000_000 * (10 - age), 1_000_000_000 * (10 - age)))
    CheckpointSync(mirror, "run1", scratch).sync()
    assert mirror.uploaded == [f"jobs/run1/{name}" for name in names]


def test_the_sweep_removes_the_checkpoints_of_jobs_that_ended(tmp_path: Path, tiny_model_dir: Path) -> None:
    shared = (tmp_path / "shared").as_uri()
    store = open_store(tmp_path / "data", sync=False, blob_url=shared)
    mirror = DirectoryBlobs(shared)
    owner, _, live = queue_job(store, tiny_model_dir)
    _, _, deleted = queue_job(store, tiny_model_dir, owner)
    for run_id in (live, deleted, "gone"):
        (tmp_path / "ckpt").write_bytes(run_id.encode())
        mirror.upload(f"jobs/{run_id}/train.ckpt", str(tmp_path / "ckpt"))
    store.delete_datablock(owner, deleted)
    assert sweep(mirror, store, core()) == 2
    assert mirror.names("jobs/") == [f"jobs/{live}/train.ckpt"]  # a queued job keeps its own
    store.close()


@pytest.mark.slow
def test_a_job_whose_machine_died_resumes_on_another_from_the_blob_store(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    database, blobs = f"sqlite:///{tmp_path / 'shared.db'}", (tmp_path / "shared blobs").as_uri()
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    store = open_store(machine_a, sync=False, database_url=database, blob_url=blobs)
    owner, file_id, reference = queue_job(store, tiny_model_dir, **SLOW_CONFIG)
    store.set_file_processed(owner, file_id, None)
    assert run_job(reference, machine_a, database, blobs) == 0  # uninterrupted, for comparison
    expected = Cartridge.load(store.datablock_cartridge_path(owner, reference))
    _, file_id, run_id = queue_job(store, tiny_model_dir, owner, **SLOW_CONFIG)
    store.set_file_processed(owner, file_id, None)

    # Machine A's worker trains past a checkpoint, which reaches the blob store; then the
    # machine dies (kill -9: nothing of the worker's own runs).
    env = {**os.environ, DATABASE_URL_ENV: database, BLOB_URL_ENV: blobs, "CARTRIDGES_WORKER_THREADS": "1",
           "SLOW_JOB_STEP_S": "0.3", "PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_JOBS),
                                                                                 os.environ.get("PYTHONPATH")]))}
    worker = subprocess.Popen([sys.executable, "-m", "cartridges.jobs.worker", run_id, str(machine_a)], env=env)
    mirror = DirectoryBlobs(blobs)
    deadline = time.monotonic() + 120
    # The training state and the data it was trained on (copied before it), both of which B restores.
    wanted = {f"jobs/{run_id}/train.ckpt", f"jobs/{run_id}/train.ckpt.data.pt"}
    while not wanted <= set(mirror.names(f"jobs/{run_id}/")):
        assert worker.poll() is None and time.monotonic() < deadline, "no training checkpoint reached the blob store"
        time.sleep(0.05)
    worker.kill()
    worker.wait()
    assert store.get_datablock(owner, run_id).status == "running"

    # Machine B (its own data directory: nothing of A's disk) takes the job over once A's
    # heartbeat is older than the lease, and resumes from the blob store's checkpoints.
    from cartridges.jobs import progress as progress_module

    monkeypatch.setattr(progress_module, "LEASE_S", 1.0)
    time.sleep(2.1)
    with caplog.at_level(logging.INFO, logger="cartridges.jobs"):
        assert run_job(run_id, machine_b, database, blobs) == 0
    restored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored checkpoints")]
    assert restored and "train.ckpt.data.pt" in restored[0] and "train.ckpt," in restored[0] + ","
    record = store.get_datablock(owner, run_id)
    assert (record.status, record.attempts) == ("succeeded", 2), (record.error_code, record.error_message)
    resumed = Cartridge.load(store.datablock_cartridge_path(owner, run_id))
    for got, want in zip(resumed.keys + resumed.values, expected.keys + expected.values):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert mirror.names("jobs/") == []  # the job ended: its checkpoints are gone from the blob store
    store.close()
