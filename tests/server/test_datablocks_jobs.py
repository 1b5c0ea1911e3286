"""Training jobs under stress, on a live server with a tiny model: cancel while queued,
synthesizing and training; kill -9 of the server mid-synthesis and mid-training (the job
resumes from its checkpoints to the very cartridge of an uninterrupted run); kill -9 of the
worker alone (the server stays up, the job fails with the reason, the next one runs).

The server runs with slow_jobs/ on its PYTHONPATH, whose sitecustomize slows each synthesis
batch and training step of its jobs so that the tests can act while a stage is in progress."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from cartridges import Client

from .conftest import API_KEY, LiveServer, upload_text
from .test_datablocks_api import stored_cartridge
from .tiny_hf_model import DOCUMENT, TINY_TRAIN_CONFIG

pytestmark = pytest.mark.slow

STEP_DELAY_S = 0.3
SLOW_JOBS = Path(__file__).parent / "slow_jobs"
# 8 synthesis batches and 8 training steps, each at least STEP_DELAY_S; checkpoints every 2 steps.
SLOW_CONFIG = {**TINY_TRAIN_CONFIG, "num_samples": 16, "checkpoint_every": 2, "seed": 3}


@pytest.fixture
def slow_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path / "data", model=tiny_model_dir,
                      env={"SLOW_JOB_STEP_S": str(STEP_DELAY_S), "CARTRIDGES_WORKER_THREADS": "1",
                           "PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_JOBS), os.environ.get("PYTHONPATH")]))})
    live.start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """Clients made by a test, closed after it whatever happens."""
    made: list[Client] = []
    yield made
    for client in made:
        client.close()


def connect(server: LiveServer, clients: list[Client]) -> Client:
    clients.append(Client(server.url, API_KEY))
    return clients[-1]


def wait_until(condition: Callable[[], object], timeout: float = 60, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def at_stage(client: Client, block_id: str, stage: str, completed: int) -> Callable[[], bool]:
    def check() -> bool:
        p = client.datablocks.retrieve(block_id)["progress"]
        return p["stage"] == stage and p["completed"] >= completed
    return check


def workers(server: LiveServer) -> list[psutil.Process]:
    """The server's live worker processes (an exited one not reaped yet does not count)."""
    assert server.proc is not None
    found = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if "cartridges.jobs.worker" in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found


def scratch_dirs(server: LiveServer) -> list[str]:
    return sorted(p.name for p in (server.data_dir / "jobs").iterdir())


def finish(client: Client, block_id: str) -> dict:
    return client.datablocks.wait(block_id, timeout=180, poll_interval=0.1, progress=False)


def test_cancel_while_queued_synthesizing_and_training(slow_server: LiveServer, clients: list[Client]) -> None:
    client = connect(slow_server, clients)
    file_id = upload_text(slow_server.openai(), DOCUMENT)
    blobs = slow_server.blob_names()
    first = client.datablocks.train(file_id, config=SLOW_CONFIG)
    queued = client.datablocks.train(file_id, config=SLOW_CONFIG)
    wait_until(at_stage(client, first["id"], "synthesizing", 2), what="synthesis")
    # Queued behind the first (one job at a time): deleting it touches nothing else.
    assert client.datablocks.retrieve(queued["id"])["status"] == "queued"
    client.datablocks.delete(queued["id"])
    assert client.datablocks.retrieve(first["id"])["status"] == "running"

    # Synthesizing: the worker stops within seconds and leaves nothing behind.
    client.datablocks.delete(first["id"])
    wait_until(lambda: not workers(slow_server), timeout=10, what="the worker to stop")
    assert scratch_dirs(slow_server) == [] and slow_server.tmp_names() == []

    training = client.datablocks.train(file_id, config=SLOW_CONFIG)
    wait_until(at_stage(client, training["id"], "training", 2), what="training")
    client.datablocks.delete(training["id"])
    wait_until(lambda: not workers(slow_server), timeout=10, what="the worker to stop")
    assert scratch_dirs(slow_server) == [] and slow_server.tmp_names() == []
    assert slow_server.blob_names() == blobs  # no cartridge of a cancelled job, ever

    # The machine moves on to the next job.
    fast = client.datablocks.train(file_id, config=TINY_TRAIN_CONFIG)
    assert finish(client, fast["id"])["status"] == "succeeded"
    assert [b["id"] for b in client.datablocks.list()] == [fast["id"]]


@pytest.mark.parametrize("stage", ["synthesizing", "training"])
def test_server_killed_mid_job_resumes_to_the_same_cartridge(slow_server: LiveServer, stage: str,
                                                            clients: list[Client]) -> None:
    client = connect(slow_server, clients)
    file_id = upload_text(slow_server.openai(), DOCUMENT)
    reference = client.datablocks.train(file_id, name="reference", config=SLOW_CONFIG)
    assert finish(client, reference["id"])["status"] == "succeeded"
    expected = stored_cartridge(slow_server, reference["id"])

    block = client.datablocks.train(file_id, config=SLOW_CONFIG)
    wait_until(at_stage(client, block["id"], stage, 4), what=stage)
    worker = workers(slow_server)[0]
    slow_server.stop(kill=True)  # kill -9: no shutdown code runs
    worker.wait(timeout=10)  # the worker dies with its server (it must never run twice)

    slow_server.start()
    client = connect(slow_server, clients)
    interrupted = client.datablocks.retrieve(block["id"])
    assert interrupted["status"] in ("running", "succeeded")  # resumed, never failed
    done = finish(client, block["id"])
    assert done["status"] == "succeeded", done
    resumed = stored_cartridge(slow_server, block["id"])
    for got, want in zip(resumed.keys + resumed.values, expected.keys + expected.values):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Earlier datablocks are intact; nothing partial is left.
    assert client.datablocks.retrieve(reference["id"])["status"] == "succeeded"
    assert stored_cartridge(slow_server, reference["id"]).checksum() == expected.checksum()
    assert slow_server.tmp_names() == [] and scratch_dirs(slow_server) == []


def test_worker_killed_fails_its_job_and_the_server_goes_on(slow_server: LiveServer,
                                                            clients: list[Client]) -> None:
    client = connect(slow_server, clients)
    file_id = upload_text(slow_server.openai(), DOCUMENT)
    doomed = client.datablocks.train(file_id, config=SLOW_CONFIG)
    nxt = client.datablocks.train(file_id, config=TINY_TRAIN_CONFIG)
    wait_until(at_stage(client, doomed["id"], "synthesizing", 1), what="synthesis")
    workers(slow_server)[0].kill()
    failed = finish(client, doomed["id"])
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "worker_crashed" and "SIGKILL" in failed["error"]["message"]
    assert slow_server.alive()
    assert finish(client, nxt["id"])["status"] == "succeeded"
    assert scratch_dirs(slow_server) == []
