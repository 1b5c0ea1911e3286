"""Training jobs: datablocks trained in a supervised worker process (docs/design.md, "Training jobs").

- `worker`: `run_job(run_id, data_dir)`, the worker's entry point, one job per process.
- `progress`: progress, metrics and the heartbeat the worker writes into the store.
- `supervisor`: runs in the server; starts workers, notices crashes, resumes after restarts.

A job's config is the library's `TrainConfig` (cartridges.selfstudy.config), as the request
gave it; the worker decides what it leaves to the corpus and stores the result.
"""

from .supervisor import Supervisor

__all__ = ["Supervisor"]
