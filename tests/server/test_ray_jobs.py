"""Training jobs on a Ray cluster (CARTRIDGES_JOB_BACKEND=ray): a local cluster started here
with `ray start --head`, a live server that submits its jobs there. A job runs as a Ray task
(no worker process in the server), reports progress, is cancelled, and survives the kill of
its Ray worker by resuming from its checkpoints. Last, the whole topology: two replicas with
PostgreSQL, S3 and the cluster.

The cluster's workers load tests/server/slow_jobs (see test_datablocks_jobs.py) so that a job's
stages last long enough to act on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cartridges import Client

from .conftest import API_KEY, LiveServer, free_port, running_replicas, served_by, upload_text
from .test_datablocks_jobs import SLOW_CONFIG, SLOW_JOBS, STEP_DELAY_S, at_stage, wait_until
from .tiny_hf_model import DOCUMENT

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

TASK_TITLE = "ray::run_training_job"
# A throwaway cluster on this machine: no token between the server and the cluster.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def _ray(log: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """The `ray` CLI, its output to a file: the daemons it starts keep any pipe open."""
    cli = str(Path(sys.executable).with_name("ray"))
    with open(log, "ab") as out:
        done = subprocess.run([cli, *args], stdout=out, stderr=subprocess.STDOUT, timeout=120, env=env)
    assert done.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory, s3_server) -> Iterator[str]:
    """The cluster's address. Its nodes are configured for the test's S3 endpoint (AWS_*), as a
    deployment's nodes would be for its object store."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    env = dict(os.environ, SLOW_JOB_STEP_S=str(STEP_DELAY_S), RAY_USAGE_STATS_ENABLED="0", **NO_AUTH, **s3_server.env,
               PYTHONPATH=os.pathsep.join(filter(None, [str(SLOW_JOBS), os.environ.get("PYTHONPATH")])))
    # One GPU declared (a logical resource: the tasks still run on CPUs here) for worker_gpus.
    _ray(log, "start", "--head", "--port", str(port), "--num-cpus", "2", "--num-gpus", "1",
         "--include-dashboard=false", "--disable-usage-stats", env=env)
    try:
        # The head listens on the address Ray takes for this node, not on loopback.
        yield f"{ray.util.get_node_ip_address()}:{port}"
    finally:
        _ray(log, "stop", "--force")


@pytest.fixture
def ray_server(tmp_path: Path, tiny_model_dir: Path, ray_address: str) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path / "data", model=tiny_model_dir,
                      env={"CARTRIDGES_JOB_BACKEND": "ray", "RAY_ADDRESS": ray_address, **NO_AUTH,
                           "CARTRIDGES_WORKER_THREADS": "1"})
    live.start()
    try:
        yield live
    finally:
        live.stop()


def _task_processes() -> list[psutil.Process]:
    """Ray workers running a training job now (their process title names the task)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].startswith(TASK_TITLE):
            found.append(proc)
    return found


def _local_workers(server: LiveServer) -> list[psutil.Process]:
    assert server.proc is not None
    return [c for c in psutil.Process(server.proc.pid).children(recursive=True)
            if "cartridges.jobs.worker" in " ".join(c.cmdline())]


def _attempts(server: LiveServer, datablock_id: str) -> int:
    from cartridges.store import core, open_store

    store = open_store(server.data_dir)
    try:
        return store.get_datablock(core().Owner(0, True), datablock_id).attempts
    finally:
        store.close()


def test_a_job_runs_on_the_cluster_reports_progress_and_is_cancelled(ray_server: LiveServer) -> None:
    with Client(ray_server.url, API_KEY) as client:
        file_id = upload_text(ray_server.openai(), DOCUMENT)
        block = client.datablocks.train(file_id, config=SLOW_CONFIG)
        wait_until(at_stage(client, block["id"], "synthesizing", 2), what="progress from the cluster")
        assert _task_processes(), "no Ray worker runs the job"
        assert _local_workers(ray_server) == []
        done = client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)
        assert done["status"] == "succeeded", done
        assert _attempts(ray_server, block["id"]) == 1 and done["metrics"]["train_tokens"] > 0

        # Cancelled (deleted) while it runs: the task stops within seconds, nothing is kept.
        blobs = ray_server.blob_names()
        cancelled = client.datablocks.train(file_id, config=SLOW_CONFIG)
        wait_until(at_stage(client, cancelled["id"], "synthesizing", 2), what="the second job")
        client.datablocks.delete(cancelled["id"])
        wait_until(lambda: not _task_processes(), timeout=30, what="the task to stop")
        assert ray_server.blob_names() == blobs


def test_a_job_asks_the_cluster_for_the_gpus_of_worker_gpus(tmp_path: Path, tiny_model_dir: Path,
                                                            ray_address: str) -> None:
    """CARTRIDGES_WORKER_GPUS=1: the job's task holds the cluster's one GPU while it runs."""
    server = LiveServer(tmp_path / "data", model=tiny_model_dir,
                        env={"CARTRIDGES_JOB_BACKEND": "ray", "RAY_ADDRESS": ray_address, **NO_AUTH,
                             "CARTRIDGES_WORKER_THREADS": "1", "CARTRIDGES_WORKER_GPUS": "1"})
    for (server,) in running_replicas(server):
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            assert ray.cluster_resources().get("GPU") == 1
            with Client(server.url, API_KEY) as client:
                file_id = upload_text(server.openai(), DOCUMENT)
                block = client.datablocks.train(file_id, config={**SLOW_CONFIG, "num_samples": 64})
                wait_until(at_stage(client, block["id"], "synthesizing", 2), what="the job on the cluster")
                assert ray.available_resources().get("GPU", 0) == 0  # held by the job's task
                done = client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)
                assert done["status"] == "succeeded", done
            wait_until(lambda: ray.available_resources().get("GPU", 0) == 1, timeout=30, what="the GPU back")
        finally:
            ray.shutdown()


def test_a_job_survives_the_kill_of_its_ray_worker(ray_server: LiveServer) -> None:
    with Client(ray_server.url, API_KEY) as client:
        file_id = upload_text(ray_server.openai(), DOCUMENT)
        block = client.datablocks.train(file_id, config=SLOW_CONFIG)
        wait_until(at_stage(client, block["id"], "training", 4), timeout=120, what="training past a checkpoint")
        tasks = _task_processes()
        assert len(tasks) == 1
        os.kill(tasks[0].pid, signal.SIGKILL)
        done = client.datablocks.wait(block["id"], timeout=180, poll_interval=0.2, progress=False)
        assert done["status"] == "succeeded", done
        assert _attempts(ray_server, block["id"]) == 2  # Ray ran the task again; it resumed
        assert ray_server.alive()


def test_the_whole_topology_postgresql_s3_and_ray(tmp_path: Path, tiny_model_dir: Path, ray_address: str,
                                                   postgres_url: str, s3_server, s3_blob_url: str) -> None:
    """Two replicas as on two machines (their own data directories), one PostgreSQL database,
    one bucket, one Ray cluster: a datablock trained through one runs on the cluster, in
    neither replica, and the other serves its cartridge."""
    from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV

    env = {DATABASE_URL_ENV: postgres_url, BLOB_URL_ENV: s3_blob_url, "CARTRIDGES_JOB_BACKEND": "ray",
           "RAY_ADDRESS": ray_address, "CARTRIDGES_WORKER_THREADS": "1", **NO_AUTH, **s3_server.env}
    replicas = running_replicas(LiveServer(tmp_path / "first", model=tiny_model_dir, env=env),
                                LiveServer(tmp_path / "second", model=tiny_model_dir, env=env))
    first, second = next(replicas)
    try:
        key = first.add_user("alice")
        file_id = upload_text(first.openai(key), DOCUMENT)
        with Client(first.url, key) as client:
            block = client.datablocks.train(file_id, config=SLOW_CONFIG)
            wait_until(at_stage(client, block["id"], "synthesizing", 2), what="progress from the cluster")
        assert _task_processes() and _local_workers(first) == [] and _local_workers(second) == []
        served_by(second, key, block["id"])
    finally:
        replicas.close()
