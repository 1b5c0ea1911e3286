"""Giving the heap's free memory back to the system.

glibc's malloc keeps memory that was freed, and a run of allocations of many different sizes
(the teacher's scoring: logits of as many rows and tokens as each batch happens to have) leaves
it fragmented: a process's resident memory then grows with every batch although what it holds
does not (measured: about 150 MB per synthesis batch of 16 conversations with the default
model, 16 GB over a 17K-token corpus; docs/experiments.md, "What does training cost, and how
does it grow with the corpus and the cartridge?"). `malloc_trim` hands the free pages back."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only: musl and others have no malloc_trim)
        return libc
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Returns the heap's free pages to the system (glibc); nothing elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
