"""Slows a training job's every step, for tests that act while a stage is in progress.

Python imports `sitecustomize` at start-up from the path, so a server started with this folder
on PYTHONPATH, and the job workers it starts (they inherit its environment), load it. With
SLOW_JOB_STEP_S set, each progress update of a job (one per synthesis batch and per training
step) sleeps that long after it is recorded."""

import os
import time

_delay = float(os.environ.get("SLOW_JOB_STEP_S") or 0)
if _delay > 0:
    from cartridges.jobs.progress import JobProgress

    _update = JobProgress.update

    def _slow_update(self, *args, **kwargs):
        _update(self, *args, **kwargs)
        time.sleep(_delay)

    JobProgress.update = _slow_update
