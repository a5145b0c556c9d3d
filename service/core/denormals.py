"""Denormal floats flushed to zero while a graph runs (ATTEND_FLUSH_DENORMALS, on by default).

A masked score's exponential underflows to a denormal on its way to 0. Where the CPU takes a microcode
assist for each such result (Intel's cores under MLAS's AVX-512F softmax), a masked run costs several times
an unmasked one; with MXCSR's flush-to-zero and denormals-are-zero bits set it does not (`python
bench/underflow.py`). The bits are per thread, and ONNX Runtime's own option (session.set_denormal_as_zero)
sets them on its pool's threads only, not on the thread that calls run() (and, for good, on the thread that
makes a process's first session: `kept` puts them back). So each run sets them on its thread and puts the
thread's bits back after: the event loop's NumPy, and a caller's thread, keep IEEE
denormals. A result below float32's smallest normal (1.2e-38) then reads 0. x86-64 with glibc only;
elsewhere nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

FTZ = 0x8000  # MXCSR's flush-to-zero bit
DAZ = 0x0040  # its denormals-are-zero bit
BITS = FTZ | DAZ
T = TypeVar("T")

enabled = True  # the setting, as the loader last set it (service.core.runtime.Loader)


class _Env(ctypes.Structure):
    """glibc's fenv_t on x86-64: the x87 environment (28 bytes), then MXCSR."""

    _fields_ = [("x87", ctypes.c_byte * 28), ("mxcsr", ctypes.c_uint32)]


def _libm() -> ctypes.CDLL | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        return ctypes.CDLL("libm.so.6")
    except OSError:
        return None


_LIBM = _libm()
supported = _LIBM is not None


def set_flush(on: bool, bits: int = BITS) -> None:
    """Set (or clear) `bits` of this thread's MXCSR, until set otherwise."""
    if _LIBM is None:
        return
    env = _Env()
    _LIBM.fegetenv(ctypes.byref(env))
    env.mxcsr = (env.mxcsr | bits) if on else (env.mxcsr & ~bits)
    _LIBM.fesetenv(ctypes.byref(env))


def run(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` with the bits set on this thread while it runs, where the setting is on; the thread's
    own bits put back after."""
    if not enabled or _LIBM is None:
        return call(*args)
    saved = _Env()
    _LIBM.fegetenv(ctypes.byref(saved))
    if saved.mxcsr & BITS == BITS:
        return call(*args)
    flushed = _Env.from_buffer_copy(saved)
    flushed.mxcsr |= BITS
    _LIBM.fesetenv(ctypes.byref(flushed))
    try:
        return call(*args)
    finally:
        _LIBM.fesetenv(ctypes.byref(saved))


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """This thread's bits as they were, once the block ends: the first session of a process made with
    session.set_denormal_as_zero sets them on the thread that makes it, for good."""
    if _LIBM is None:
        yield
        return
    saved = _Env()
    _LIBM.fegetenv(ctypes.byref(saved))
    try:
        yield
    finally:
        _LIBM.fesetenv(ctypes.byref(saved))


def flushing() -> bool:
    """Whether this thread flushes denormal results to zero."""
    if _LIBM is None:
        return False
    env = _Env()
    _LIBM.fegetenv(ctypes.byref(env))
    return bool(env.mxcsr & FTZ)
