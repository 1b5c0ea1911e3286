"""Training jobs as tasks on a Ray cluster (`CARTRIDGES_JOB_BACKEND=ray`; the cluster named by
the standard RAY_ADDRESS, or a local one started in the server when it is unset).

A task runs the worker's own entry point (`worker.run_job`) with the server's store settings, so
a job on the cluster reads its corpus from the store, reports progress to the database and
writes its cartridge through the store exactly as a local worker process does. The supervisor
holds each task through `RayTask`, which answers as the `subprocess.Popen` of a local worker
does (poll, kill, wait). A task whose Ray worker dies is retried by Ray up to MAX_ATTEMPTS - 1
times, resuming from the job's checkpoints; after that the job fails with `worker_crashed`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

# The process title of a Ray worker while it runs a job: "ray::run_training_job".
TASK_NAME = "run_training_job"


def connect() -> None:
    """Joins the cluster at RAY_ADDRESS, or starts a local one, once per process."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)


def run_training_job(run_id: str, data_dir: str, env: Mapping[str, str], threads: int) -> int:
    """The task: the worker's entry point, in a Ray worker process."""
    os.environ.update(env)
    import torch

    from ..store import BLOB_URL_ENV, DATABASE_URL_ENV
    from .worker import WORKER_DEVICE_ENV, run_job

    torch.set_num_threads(threads)
    if torch.cuda.is_available():  # Ray shows a task only the GPUs it asked for (num_gpus)
        os.environ[WORKER_DEVICE_ENV] = "cuda"
    return run_job(run_id, data_dir, env.get(DATABASE_URL_ENV, ""), env.get(BLOB_URL_ENV, ""))


class RayTask:
    """A job's task on the cluster, seen as a worker process: poll() is None while it runs, then
    run_job's exit status (-SIGKILL when its Ray worker died every time it was tried)."""

    pid = None  # no process of this server runs it

    def __init__(self, run_id: str, data_dir: str, env: Mapping[str, str], threads: int,
                 max_attempts: int, gpus: float = 0.0) -> None:
        import ray

        # Asks for `threads` CPUs and `gpus` GPUs; Ray shows the task only the GPUs it was given
        # (CUDA_VISIBLE_DEVICES), so the worker's model goes to CUDA exactly when it has one.
        remote = ray.remote(run_training_job).options(
            name=TASK_NAME, num_cpus=threads, num_gpus=gpus, max_retries=max_attempts - 1, retry_exceptions=False)
        self._ref: Any = remote.remote(run_id, data_dir, dict(env), threads)
        self._code: int | None = None

    def poll(self) -> int | None:
        import ray

        if self._code is None:
            ready, _ = ray.wait([self._ref], timeout=0)
            if ready:
                try:
                    self._code = int(ray.get(self._ref))
                except (ray.exceptions.WorkerCrashedError, ray.exceptions.TaskCancelledError,
                        ray.exceptions.NodeDiedError):
                    self._code = -signal.SIGKILL
                except ray.exceptions.RayError:
                    self._code = 1
        return self._code

    def kill(self) -> None:
        import ray

        ray.cancel(self._ref, force=True)

    def wait(self, timeout: float | None = None) -> int | None:
        import ray

        ray.wait([self._ref], timeout=timeout)
        return self.poll()
