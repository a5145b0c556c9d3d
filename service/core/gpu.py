"""The GPU's memory, read through NVIDIA's management library (nvidia-ml-py), where it is installed."""

from __future__ import annotations

import logging

log = logging.getLogger("service")

# What the runs of all the workers on one GPU may take of its memory: the rest is the sessions' weights,
# their CUDA contexts and ONNX Runtime's arenas rounding up.
SHARE = 0.8


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
    """ATTEND_MAX_DEVICE_BYTES resolved: as set; else on CUDA SHARE of the GPU's memory over the workers; else 0
    (none: on the CPU, ATTEND_MAX_INFLIGHT_BYTES counts the runs' memory already)."""
    if setting or not on_cuda:
        return setting
    total = total_memory()
    return int(total * SHARE) // workers if total else 0
