"""Opening an ONNX Runtime session on a graph of the repository: the providers asked for, CUDA's libraries
loaded, why CUDA was not used where it was asked for, the file checked against config.json first."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnxruntime as ort

from export.repository import CPU_GRAPH_LOG_SEVERITY, ModelConfig, one_head_axis, sha256_of, shape_agrees
from service.core import denormals

if TYPE_CHECKING:
    from service.core.runtime import LoadedModel

log = logging.getLogger("service")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
_ORT_TYPES = {"float32": "tensor(float)", "int64": "tensor(int64)"}


class StartupError(RuntimeError):
    """The service cannot start as configured; the message is the one-line reason."""


def providers_for(device: str, cuda_tf32: bool) -> list[Any]:
    cuda = (CUDA, {"use_tf32": "1" if cuda_tf32 else "0"})
    if device == "cpu":
        return [CPU]
    if device == "cuda":
        return [cuda]
    return [cuda, CPU] if CUDA in ort.get_available_providers() else [CPU]


def preload_cuda() -> None:
    # With onnxruntime-gpu[cuda,cudnn] the CUDA and cuDNN libraries are pip wheels (the `nvidia`
    # namespace package); this loads them. Without them, CUDA may still come from the system.
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None and importlib.util.find_spec("nvidia") is not None:
        try:
            preload()
        except Exception as e:  # a machine without the wheels: CUDA may still load from the system
            log.debug("onnxruntime.preload_dlls failed: %s", e)


@contextlib.contextmanager
def stderr_captured() -> Iterator[list[str]]:
    """What the process writes to fd 2 meanwhile (ONNX Runtime logs from C++, past Python's logging):
    the list holds it once the block is left."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured: list[str] = []
    # In memory where it can be (Linux): a read-only root filesystem has no temporary folder.
    memory = hasattr(os, "memfd_create")
    with open(os.memfd_create("attend-stderr"), "w+b") if memory else tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode(errors="replace"))


def _cuda_failure(ort_log: str) -> str:
    """The reason ONNX Runtime gave for not loading CUDA, in one line (its log has colours and paths)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", ort_log)
    found = re.search(r"Failed to load library \S+ with error: ([^\n]+)", text)
    if found:
        return found.group(1).strip()
    found = re.search(r"\[E:onnxruntime[^\]]*\] ([^\n]+)", text)
    return found.group(1).strip()[:300] if found else "no reason logged"


def _new_session(path: Path, options: ort.SessionOptions, providers: list[Any]) -> tuple[ort.InferenceSession, str]:
    """The session, and why CUDA was not loaded when it was asked for and the session fell back.

    Where CUDA cannot load, ONNX Runtime logs a red error and a warning, then runs on the CPU: on a
    machine without a GPU that is the expected outcome, said once by the caller in one line, so its
    log is captured here rather than shown."""
    if CUDA not in str(providers):
        with denormals.kept():
            return ort.InferenceSession(str(path), sess_options=options, providers=providers), ""
    with stderr_captured() as captured, denormals.kept():
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    if session.get_providers()[0] == CUDA:
        sys.stderr.write(captured[0])  # nothing to hide: pass on whatever it said
        return session, ""
    return session, _cuda_failure(captured[0])


# Every session of the process allocates on the CPU from one arena (ONNX Runtime's environment allocator),
# extended by what each allocation asks for. An arena of a session's own keeps the most that session ever
# used, up to twice that where it grows by doubling, and a repository's ~15 sessions add theirs up
# (docs/reliability.md, "What ONNX Runtime keeps").
_ARENA = {"arena_extend_strategy": 1}  # kSameAsRequested
_arena_lock = threading.Lock()
_arena_made = False
# A run with these gives the arena's free regions back to the system at its end (`shrink_arena`).
_SHRINK = ort.RunOptions()
_SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


def _use_shared_arena(options: ort.SessionOptions) -> None:
    global _arena_made
    with _arena_lock:
        if not _arena_made:
            cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(_ARENA))
            _arena_made = True
    options.add_session_config_entry("session.use_env_allocators", "1")


def shrink_arena(session: ort.InferenceSession, feed: dict[str, Any]) -> None:
    """The shared arena's free regions back to the system: a run of `session` (any, on a small `feed`) that
    shrinks it at its end."""
    session.run(None, feed, _SHRINK)


def _session_options(intra_op_threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    _use_shared_arena(options)
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if denormals.enabled:  # ORT's own pool threads (intra_op_threads > 1); the caller's: service.core.denormals
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return options


def check_file(model_dir: Path, config: ModelConfig, graph: tuple[str, str, int]) -> None:
    """That the file of `graph` ((file, sha256, opset) from config.json) is there and has the sha256 that
    config.json names."""
    file, sha256, _ = graph
    path = model_dir / file
    relative = f"{model_dir.name}/{file}"
    try:
        if not path.is_file():
            raise StartupError(f"model {config.name}: {relative} is missing")
        digest = sha256_of(path)
    except OSError as e:
        raise StartupError(f"model {config.name}: {cannot_read(relative, e)}") from None
    if digest != sha256:
        raise StartupError(f"model {config.name}: sha256 of {relative} is {digest}, config.json says {sha256}")


def cannot_read(what: str, error: OSError) -> str:
    """`what` cannot be read, and why; with a permission error the service's user, often not the one who
    exported (a container's)."""
    whom = f" (the service runs as uid {os.getuid()})" if error.errno in (errno.EACCES, errno.EPERM) else ""
    return f"{what} cannot be read: {error.strerror or error}{whom}"


def open_session(model_dir: Path, config: ModelConfig, graph: tuple[str, str, int], intra_op_threads: int,
          providers: list[Any]) -> tuple[ort.InferenceSession, str]:
    """A session on `graph`, and why CUDA was not loaded, where it was asked for."""
    options = _session_options(intra_op_threads)
    if graph != config.graph_for(cpu=False):  # a model.cpu.onnx (export.repository.CPU_GRAPH_LOG_SEVERITY)
        options.log_severity_level = CPU_GRAPH_LOG_SEVERITY
    try:
        return _new_session(model_dir / graph[0], options, providers)
    except Exception as e:
        raise StartupError(f"model {config.name}: ONNX Runtime cannot load {model_dir.name}/{graph[0]}: "
                           f"{without_paths(str(e), model_dir)}") from e


def without_paths(text: str, model_dir: Path) -> str:
    """A library's message with the repository's location taken out (it is the server's business)."""
    return text.replace(str(model_dir.parent.resolve()) + "/", "").replace(str(model_dir.parent) + "/", "")


def check_signature(model: LoadedModel, session: ort.InferenceSession | None = None,
                     weights: bool | None = None) -> None:
    """That the session's (or `session`'s: a graph without the weights, unless `weights`) inputs and outputs
    are config.json's (but attention_weights, for that graph)."""
    weights = session is None if weights is None else weights
    session = session or model.session
    got_in = [(i.name, i.type, list(i.shape)) for i in session.get_inputs()]
    want_in = [(s.name, _ORT_TYPES[s.dtype], list(s.shape)) for s in model.config.input_specs()]
    got_out = [(o.name, o.type, list(o.shape)) for o in session.get_outputs()]
    want_out = [(s.name, _ORT_TYPES[s.dtype], list(s.shape)) for s in model.config.output_specs()
                if weights or s.name != "attention_weights"]

    def agree(got: list[tuple[str, str, list]], want: list[tuple[str, str, list]], outputs: bool = False) -> bool:
        # An output may have the axis of a one-head Attention node's weights besides (`LoadedModel.run` views it away).
        return len(got) == len(want) and all(
            g[:2] == w[:2] and (shape_agrees(g[2], w[2]) or outputs and one_head_axis(g[2], w[2]))
            for g, w in zip(got, want, strict=False))

    if not (agree(got_in, want_in) and agree(got_out, want_out, outputs=True)):
        raise StartupError(
            f"model {model.name}: the graph's inputs/outputs {got_in + got_out} do not match config.json "
            f"{want_in + want_out}"
        )
