"""Training jobs: datablocks trained in a supervised worker process (docs/design.md, "Training jobs").

- `config`: the request's `config` → a full `TrainConfig` (unknown fields refused).
- `worker`: `run_job(run_id, data_dir)`, the worker's entry point, one job per process.
- `progress`: progress, metrics and the heartbeat the worker writes into the store.
- `supervisor`: runs in the server; starts workers, notices crashes, resumes after restarts.
"""

from .config import ConfigError, base_model_id, train_config_from_request
from .supervisor import Supervisor

__all__ = ["ConfigError", "Supervisor", "base_model_id", "train_config_from_request"]
