"""The CPU cores this process may use, counted one way for everyone who divides them (the
serving engine, training workers, the status page)."""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """The cores of this process's CPU affinity (what a container or `taskset` allows), or
    every core where the platform cannot say."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
