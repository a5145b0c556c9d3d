"""The GPU's memory, read through NVIDIA's management library (nvidia-ml-py), where it is installed."""

from __future__ import annotations

import logging

log = logging.getLogger("service")

# What the workers on one GPU may take of its memory in all; the rest is left to the driver and to
# ONNX Runtime's arenas rounding up.
SHARE = 0.8
# What a worker holds before any request: its CUDA context, its sessions and their warm-up's arenas
# (`python bench/scaling.py` measures it: docs/benchmarks.md, "Many cores, one GPU"), with room above.
WORKER_BYTES = 3 << 30


def total_memory(device: int = 0) -> int | None:
    """The GPU's memory in bytes, or None where NVML cannot tell (no nvidia-ml-py, no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device)).total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        log.warning("cannot read the GPU's memory (NVML: %s): ATTEND_MAX_DEVICE_BYTES is the only bound", e)
        return None


def device_budget(setting: int, on_cuda: bool, workers: int) -> int:
    """ATTEND_MAX_DEVICE_BYTES resolved: as set; else on CUDA a worker's share of SHARE of the GPU's memory, less
    what it holds already; else 0 (none: on the CPU, ATTEND_MAX_INFLIGHT_BYTES counts the runs' memory)."""
    if setting or not on_cuda:
        return setting
    total = total_memory()
    return max(int(total * SHARE) // workers - WORKER_BYTES, 1 << 30) if total else 0
