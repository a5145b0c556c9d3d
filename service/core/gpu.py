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
# The least GPU memory budget a worker gets (device_budget), and what ATTEND_WORKERS=auto leaves each.
MIN_BUDGET = 1 << 30
# ATTEND_WORKERS=auto's most on one GPU: the most measured (8 CUDA contexts on a 16-core host, 4.1-6.6x one);
# each context takes its turn on the GPU, so more serve small runs no faster.
MAX_CUDA_WORKERS = 8
# What follows where the GPU's memory cannot be read, and ATTEND_MAX_DEVICE_BYTES is 0.
NO_BUDGET = "no GPU memory budget unless ATTEND_MAX_DEVICE_BYTES is set"


def total_memory(otherwise: str | None = NO_BUDGET, device: int = 0) -> int | None:
    """The GPU's memory in bytes, or None where NVML cannot tell (no nvidia-ml-py, no driver): a warning says why
    and what follows (`otherwise`; None: no warning)."""
    try:
        import pynvml
    except ImportError:
        if otherwise is not None:
            log.warning("cannot read the GPU's memory (nvidia-ml-py is not installed: the gpu extra): %s", otherwise)
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device)).total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        log.log(logging.DEBUG if otherwise is None else logging.WARNING, "cannot read the GPU's memory (NVML: %s): %s",
                e, otherwise)
        return None


def holds(gpu_bytes: int) -> int:
    """The CUDA workers SHARE of a GPU's memory holds, each with what it holds idle and the least budget."""
    return int(gpu_bytes * SHARE) // (WORKER_BYTES + MIN_BUDGET)


def auto_workers(cores: int, device: str, gpu_bytes: int | None) -> int:
    """ATTEND_WORKERS=auto: one a core; on a GPU (NVML's `gpu_bytes` of memory, or ATTEND_DEVICE=cuda) at most
    MAX_CUDA_WORKERS, and as many as it holds."""
    if device == "cpu" or (gpu_bytes is None and device != "cuda"):
        return cores
    return max(1, min(cores, MAX_CUDA_WORKERS, MAX_CUDA_WORKERS if gpu_bytes is None else holds(gpu_bytes)))


def device_budget(setting: int, on_cuda: bool, workers: int) -> int:
    """ATTEND_MAX_DEVICE_BYTES resolved: as set; else on CUDA a worker's share of SHARE of the GPU's memory, less
    what it holds already; else 0 (none: on the CPU, ATTEND_MAX_INFLIGHT_BYTES counts the runs' memory)."""
    if setting or not on_cuda:
        return setting
    total = total_memory()
    return max(int(total * SHARE) // workers - WORKER_BYTES, MIN_BUDGET) if total else 0
