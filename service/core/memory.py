"""The process's memory: glibc's heap handed back to the system (large buffers mapped on their own,
the heaps trimmed when the service is idle)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

# Mapping buffers on their own costs page faults on every request that allocates them, so the
# threshold is no lower than a large body's buffers; no higher, so that memory goes back to the system
# after a burst of large bodies. 4 MiB holds both; docs/reliability.md has the runs that chose it.
_MMAP_THRESHOLD = 4 * 1024 * 1024
ALIGN = 64  # bytes where tensors start in buffers of ours: a cache line (ONNX Runtime copies misaligned data)


def aligned(size: int) -> int:
    """`size` rounded up to a multiple of ALIGN."""
    return -(-size // ALIGN) * ALIGN


def release_memory_eagerly() -> None:
    """glibc keeps freed memory in its heaps; large buffers (request bodies, decoded arrays) made
    the resident size grow for good after a burst. Buffers of 4 MiB and more are mapped on their
    own instead (returned to the system when freed), and the one heap is trimmed when idle
    (`trim_memory`). Measured in docs/reliability.md."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops glibc raising it by itself)
        libc.mallopt(-1, 32 * 1024 * 1024)  # M_TRIM_THRESHOLD: the rest waits for the idle trim
        # M_ARENA_MAX: one heap for every thread. A thread that found it locked got a heap of its own, and
        # malloc_trim does not give back the free end of those (only a free() past M_TRIM_THRESHOLD does):
        # after large gRPC messages, grpc's threads kept theirs resident (docs/reliability.md).
        libc.mallopt(-8, 1)


def trim_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def libc() -> Any:
    """The C library, or None where none is found (found once: find_library runs ldconfig, a process)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _libc() -> Any:
    """glibc's malloc controls, or None (another C library)."""
    c = libc()
    return c if hasattr(c, "mallopt") and hasattr(c, "malloc_trim") else None
