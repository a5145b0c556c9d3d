"""The process's memory: glibc's heap handed back to the system (large buffers mapped on their own,
the heaps trimmed when the service is idle)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

# Mapping buffers on their own costs page faults on every request that allocates them: at 256 KiB,
# W2 (4 MB bodies) took 30 ms of CPU a request instead of 17-22; at 4 MiB it is back, and 30 s after
# a burst of 25 MB bodies the resident memory is within 11-14% of before (8 MiB: 22-31%; glibc's
# own dynamic threshold, which rises to 32 MiB: 54-61%). docs/reliability.md has the runs.
_MMAP_THRESHOLD = 4 * 1024 * 1024


def release_memory_eagerly() -> None:
    """glibc keeps freed memory in its heaps; large buffers (request bodies, decoded arrays) made
    the resident size grow for good after a burst. Buffers of 4 MiB and more are mapped on their
    own instead (returned to the system when freed), and the heaps are trimmed when idle
    (`trim_memory`). Measured in docs/reliability.md."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops glibc raising it by itself)
        libc.mallopt(-1, 32 * 1024 * 1024)  # M_TRIM_THRESHOLD: the rest waits for the idle trim


def trim_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
