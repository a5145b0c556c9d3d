"""ONNX Runtime sessions, one per model of the repository. Knows nothing of HTTP.

A session is checked against its config.json (sha256 of the file, input and output names,
dtypes and shapes) before it is used, and warmed up before the service reports ready.

Which file: a session on the CPU execution provider runs the model's CPU graph where config.json has
one (`variants["cpu"]`: ONNX's `Attention` operator, export.fused), every other session model.onnx.
ONNX Runtime's CUDA kernel of `Attention` cannot return the weights (NOT_IMPLEMENTED), so the CPU graph
is never offered to CUDA: a session is opened on it only when the CPU alone runs it. Beside it, the graph
without the weights of the provider that runs, where config.json names one, for the batches that return
none: `variants["cpu_outputs"]` on the CPU, `variants["cuda_outputs"]` on CUDA (its `Attention` on CUDA's
fused kernels, which write no score matrix).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from export.repository import (
    CONFIG_FILE,
    CPU_GRAPH_LOG_SEVERITY,
    NAME_RULE,
    ModelConfig,
    TensorSpec,
    example_feed,
    list_models,
    list_versions,
    one_head_axis,
    read_config,
    sha256_of,
    shape_agrees,
    without_head_axis,
)
from export.repository import model_dir as folder_of
from service.core.statistics import ModelStatistics

log = logging.getLogger("service")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
_RUN_OPTIONS = ort.RunOptions()
_ORT_TYPES = {"float32": "tensor(float)", "int64": "tensor(int64)"}


class StartupError(RuntimeError):
    """The service cannot start as configured; the message is the one-line reason."""


@dataclass
class LoadedModel:
    config: ModelConfig
    session: ort.InferenceSession
    provider: str
    cuda_failure: str = ""  # why CUDA was not used, where it was asked for
    # The graph the session runs: config.json's model_file, or its CPU variant's file (relative to the model's
    # folder), with its sha256 and opset.
    model_file: str = ""
    sha256: str = ""
    opset: int = 0
    # Beside the graph, the one without attention_weights for the same provider (config.json's
    # variants["cpu_outputs"] or ["cuda_outputs"], where the version has one): what a batch that returns no
    # weights runs (`run`).
    session_without_weights: ort.InferenceSession | None = None
    model_file_without_weights: str = ""  # its file, relative to the model's folder
    # The layouts of request bodies already checked against this snapshot's signature, by service.protocols.attend
    # (its _Plan): they go with the snapshot, as its signature does.
    body_plans: dict[bytes, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # The hashes of layouts seen once since the last clear: a layout gets its plan when seen a second time.
    body_layouts_seen: set[int] = dataclasses.field(default_factory=set, repr=False, compare=False)
    # Triton's statistics of this snapshot (service.core.statistics): a version loaded again starts from zero.
    statistics: ModelStatistics = dataclasses.field(default_factory=ModelStatistics, repr=False, compare=False)
    # (elements of a run's inputs and outputs, its seconds) of the warm-up's timed runs (`warm_up`): where the
    # batcher's cost model of this snapshot starts (service.core.batching.RunCost).
    run_times: list[tuple[int, float]] = dataclasses.field(default_factory=list, repr=False, compare=False)
    # What the request path works out once per snapshot from its signature alone, by what it is for: the check of
    # a request's shapes (service.core.request._FeedPlan) and the batcher's reading of them (batching._SizePlan).
    derived: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def kind(self) -> str:
        return self.config.kind

    @functools.cached_property
    def version_text(self) -> str:
        """The version as every answer names it: a string, as the Open Inference Protocol's `model_version`."""
        return str(self.config.version)

    @functools.cached_property
    def version_headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's X-Model-Version header, made once per snapshot (shared: never mutated)."""
        return [(b"x-model-version", self.version_text.encode())]

    @functools.cached_property
    def _inputs(self) -> list[TensorSpec]:
        return self.config.input_specs()

    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    @functools.cached_property
    def named_input_axes(self) -> list[tuple[str, tuple[tuple[int, str], ...]]]:
        """Each input's named axes, with their positions: what a batch groups and pads by."""
        return [(s.name, tuple((i, a) for i, a in enumerate(s.shape) if a.__class__ is str)) for s in self._inputs]

    @functools.cached_property
    def input_names(self) -> frozenset[str]:
        return frozenset(s.name for s in self._inputs)

    @functools.cached_property
    def outputs(self) -> list[TensorSpec]:
        return self.config.output_specs()

    @functools.cached_property
    def _output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    @functools.cached_property
    def output_names(self) -> frozenset[str]:
        return frozenset(self._output_names)

    @functools.cached_property
    def _output_names_without_weights(self) -> list[str]:
        return [name for name in self._output_names if name != "attention_weights"]

    @functools.cached_property
    def head_axis(self) -> str | None:
        """The output the session gives with an axis of its one head that config.json does not declare
        (dot_product's weights from its CPU graph: export.repository.one_head_axis), or None."""
        declared = {s.name: s.shape for s in self.outputs}
        return next((o.name for o in self.session.get_outputs() if o.name in declared
                     and one_head_axis(list(o.shape), declared[o.name])), None)

    def run(self, feed: dict[str, np.ndarray], weights: bool = True) -> dict[str, np.ndarray]:
        """Every output of the graph by name (`outputs`, `attention_weights`, and `P` for the
        positional encoding); with `weights` False, where the model has a graph without
        attention_weights, that graph's outputs (it does not copy the weights out: 5-18% less time from
        n = 128, `python bench/compute.py`). Thread-safe: ORT allows concurrent Run on one session (and a
        RunOptions is only read by it). ONNX Runtime's public API: with a RunOptions given (ORT makes one
        a call otherwise) it costs the book's toy request ~1 us more than the private C++ session's run
        did, IO binding ~5 us more (`python bench/ort_call.py`, docs/benchmarks.md)."""
        if not weights and self.session_without_weights is not None:
            names = self._output_names_without_weights
            return dict(zip(names, self.session_without_weights.run(names, feed, _RUN_OPTIONS), strict=True))
        outputs = dict(zip(self._output_names, self.session.run(self._output_names, feed, _RUN_OPTIONS), strict=True))
        if self.head_axis is not None:  # as config.json declares it: a view
            outputs[self.head_axis] = without_head_axis(outputs[self.head_axis])
        return outputs

    def describe(self) -> dict[str, Any]:
        hp = self.config.hyperparameters
        return {
            "name": self.name,
            "kind": self.kind,
            "version": self.config.version,
            "provider": self.provider,
            "hyperparameters": hp,
            "feature_sizes": feature_sizes(self.config),
            "inputs": self.config.inputs,
            "outputs": self.config.outputs,
            "dynamic_axes": self.config.dynamic_axes,
            "max_len": hp.get("max_len"),
            "model_file": self.model_file or self.config.model_file,
            "opset": self.opset or self.config.opset,
            "sha256": self.sha256 or self.config.sha256,
            # What a batch that returns no weights runs, where it is another graph (else model_file).
            "model_file_without_weights": self.model_file_without_weights or None,
        }


def feature_sizes(config: ModelConfig) -> dict[str, Any]:
    """What a client must send, per field: an int, or 'any' (with 'same as' constraints)."""
    specs = {s.name: s for s in config.input_specs()}
    out: dict[str, Any] = {}
    for field in ("queries", "keys", "values", "scores"):
        if field in specs:
            size = specs[field].shape[-1]
            out[field] = size if isinstance(size, int) else "n_k" if size == "n_k" else "any"
    if config.kind == "dot_product":
        out["constraint"] = "queries and keys have the same feature size"
    if config.kind == "positional_encoding":
        out["queries"] = "any even"
    return out


def providers_for(device: str, cuda_tf32: bool) -> list[Any]:
    cuda = (CUDA, {"use_tf32": "1" if cuda_tf32 else "0"})
    if device == "cpu":
        return [CPU]
    if device == "cuda":
        return [cuda]
    return [cuda, CPU] if CUDA in ort.get_available_providers() else [CPU]


def _preload_cuda() -> None:
    # With onnxruntime-gpu[cuda,cudnn] the CUDA and cuDNN libraries are pip wheels (the `nvidia`
    # namespace package); this loads them. Without them, CUDA may still come from the system.
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None and importlib.util.find_spec("nvidia") is not None:
        try:
            preload()
        except Exception as e:  # a machine without the wheels: CUDA may still load from the system
            log.debug("onnxruntime.preload_dlls failed: %s", e)


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """What the process writes to fd 2 meanwhile (ONNX Runtime logs from C++, past Python's logging):
    the list holds it once the block is left."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured: list[str] = []
    with tempfile.TemporaryFile() as tmp:
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
        return ort.InferenceSession(str(path), sess_options=options, providers=providers), ""
    with _stderr_captured() as captured:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    if session.get_providers()[0] == CUDA:
        sys.stderr.write(captured[0])  # nothing to hide: pass on whatever it said
        return session, ""
    return session, _cuda_failure(captured[0])


def _check_signature(model: LoadedModel, session: ort.InferenceSession | None = None) -> None:
    """That the session's (or `session`'s: the graph without the weights) inputs and outputs are
    config.json's (but attention_weights, for that graph)."""
    weights = session is None
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


# The warm-up's sizes: a small request (the book's examples' size), and one with a few hundred times its
# elements (a run several times as long: its difference from the small one is not lost in a loaded
# machine's noise).
_WARM_SIZES = ({"batch": 2, "n_q": 3, "n_k": 4, "n": 3, "d": 8, "value_size": 8},
               {"batch": 16, "n_q": 32, "n_k": 32, "n": 32, "d": 32, "value_size": 32})
_TIMED_RUNS = 7


def warm_up(model: LoadedModel) -> None:
    """Runs on a small and a larger input, so the first client does not pay for allocation; then each
    timed a few times, the two in turn (a burst of load slows both), the fastest of each kept in
    `model.run_times`: for the batcher to know from the first request what a run of this model costs
    (a few ms a model)."""
    rng = np.random.default_rng(0)
    feeds = [example_feed(model.kind, model.config.hyperparameters, sizes, rng) for sizes in _WARM_SIZES]
    elements = []
    for feed in feeds:
        outputs = model.run(feed)
        elements.append(sum(a.size for a in feed.values()) + sum(a.size for a in outputs.values()))
        model.run(feed, weights=False)  # the graph without the weights, where there is one
    fastest = [float("inf")] * len(feeds)
    for _ in range(_TIMED_RUNS):
        for i, feed in enumerate(feeds):
            start = time.perf_counter()
            model.run(feed)
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    model.run_times.extend(zip(elements, fastest, strict=True))


def _session_options(intra_op_threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def _check_file(model_dir: Path, config: ModelConfig, graph: tuple[str, str, int]) -> None:
    """That the file of `graph` ((file, sha256, opset) from config.json) is there and has the sha256 that
    config.json names."""
    file, sha256, _ = graph
    path = model_dir / file
    relative = f"{model_dir.name}/{file}"
    if not path.is_file():
        raise StartupError(f"model {config.name}: {relative} is missing")
    digest = sha256_of(path)
    if digest != sha256:
        raise StartupError(f"model {config.name}: sha256 of {relative} is {digest}, config.json says {sha256}")


def _open(model_dir: Path, config: ModelConfig, graph: tuple[str, str, int], intra_op_threads: int,
          providers: list[Any]) -> tuple[ort.InferenceSession, str]:
    """A session on `graph`, and why CUDA was not loaded, where it was asked for."""
    options = _session_options(intra_op_threads)
    if graph != config.graph_for(cpu=False):  # a model.cpu.onnx (export.repository.CPU_GRAPH_LOG_SEVERITY)
        options.log_severity_level = CPU_GRAPH_LOG_SEVERITY
    try:
        return _new_session(model_dir / graph[0], options, providers)
    except Exception as e:
        raise StartupError(f"model {config.name}: ONNX Runtime cannot load {model_dir.name}/{graph[0]}: "
                           f"{_without_paths(str(e), model_dir)}") from e


def load_model(model_dir: Path, providers: list[Any], intra_op_threads: int, require_cuda: bool,
               version: int | None = None) -> LoadedModel:
    """A session for the model's newest version (or `version`), checked against its config.json: on the
    CPU graph where only the CPU execution provider is asked for, or where CUDA was asked for and ONNX
    Runtime fell back to the CPU; on model.onnx otherwise; beside it, one on the graph without the weights
    for that provider, where there is one. Every file config.json names must have the sha256 it names, the
    ones not served too: a version is served whole or not at all. Errors name files relative to the
    repository: they reach clients (GET /models, the load route)."""
    shown = f"{model_dir.name}/{version}" if version is not None else model_dir.name
    try:
        config = read_config(model_dir, version)
        portable, cpu_graph = config.graph_for(cpu=False), config.graph_for(cpu=True)
        without_weights = config.graph_without_weights() if cpu_graph != portable else None
        cuda_without_weights = config.graph_without_weights(cpu=False)
    except Exception as e:
        raise StartupError(f"model {shown}: unreadable config.json: {_without_paths(str(e), model_dir)}") from e
    for graph in dict.fromkeys(g for g in (portable, cpu_graph, without_weights, cuda_without_weights)
                               if g is not None):
        _check_file(model_dir, config, graph)
    # A provider given with options is a tuple (CUDA's): only a plain "CPUExecutionProvider" is the CPU.
    graph = cpu_graph if all(p == CPU for p in providers) else portable
    session, cuda_failure = _open(model_dir, config, graph, intra_op_threads, providers)
    # ORT falls back to the CPU silently when CUDA cannot load: report what really runs.
    provider = session.get_providers()[0]
    if require_cuda and provider != CUDA:
        raise StartupError(f"ATTEND_DEVICE=cuda but CUDA cannot be used ({cuda_failure}); it needs an NVIDIA GPU "
                           "and driver, CUDA 13 and cuDNN 9 (pip install 'onnxruntime-gpu[cuda,cudnn]')")
    if provider == CPU and graph != cpu_graph:
        # CUDA was asked for and ONNX Runtime fell back to the CPU: the CPU's graph, on the CPU alone.
        graph = cpu_graph
        session, _ = _open(model_dir, config, graph, intra_op_threads, [CPU])
    model = LoadedModel(config=config, session=session, provider=provider, cuda_failure=cuda_failure,
                        model_file=graph[0], sha256=graph[1], opset=graph[2])
    _check_signature(model)
    # On the CPU the session runs the CPU graph (or model.onnx, where there is none: then no graph without weights).
    outputs_graph = cuda_without_weights if provider == CUDA else without_weights
    if outputs_graph is not None:
        outputs_session, _ = _open(model_dir, config, outputs_graph, intra_op_threads,
                                   providers if provider == CUDA else [CPU])
        if outputs_session.get_providers()[0] != provider:
            raise StartupError(f"model {config.name}: {model_dir.name}/{outputs_graph[0]} does not load on "
                               f"{provider}, which runs {model_dir.name}/{graph[0]}")
        model.session_without_weights, model.model_file_without_weights = outputs_session, outputs_graph[0]
        _check_signature(model, outputs_session)
    return model


def _without_paths(text: str, model_dir: Path) -> str:
    """A library's message with the repository's location taken out (it is the server's business)."""
    return text.replace(str(model_dir.parent.resolve()) + "/", "").replace(str(model_dir.parent) + "/", "")


@dataclass
class Loader:
    """How sessions are made: the same for start-up and for every load while serving."""

    repository: Path
    device: str
    intra_op_threads: int
    cuda_tf32: bool = False
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.device != "cpu":
            _preload_cuda()
        self.providers = providers_for(self.device, self.cuda_tf32)

    def load(self, name: str, version: int | None = None) -> LoadedModel:
        """Load, check and warm up `name` (its newest version, or `version`). StartupError when it
        cannot be served, with the reason."""
        model_dir = folder_of(self.repository, name)
        if model_dir is None:
            raise StartupError(f"{name!r} is not a model's name: a name is {NAME_RULE}")
        if not (model_dir / CONFIG_FILE).is_file():
            raise StartupError(f"model {name}: no such model in the repository (no {name}/{CONFIG_FILE})")
        start = time.perf_counter()
        model = load_model(model_dir, self.providers, self.intra_op_threads, require_cuda=self.device == "cuda",
                           version=version)
        if self.warmup:
            try:
                warm_up(model)
            except Exception as e:  # warm-up failing is the model's fault too
                raise StartupError(f"model {name}: warm-up failed: {_without_paths(str(e), model_dir)}") from e
        if self.device == "auto" and model.provider != CUDA and CUDA in str(self.providers):
            # Tried once, fell back: spare the other models the same failed attempt.
            log.warning("no CUDA here (%s): the CPU execution provider serves every model", model.cuda_failure)
            self.providers = [CPU]
        log.info("loaded model %s (%s, version %d, %s) on %s in %.2fs", model.name, model.kind, model.config.version,
                 model.model_file, model.provider, time.perf_counter() - start)
        return model

    def newest(self, name: str) -> int | None:
        """The version the model's config.json names as the newest, or None (no such model, unreadable)."""
        model_dir = folder_of(self.repository, name)
        try:
            return read_config(model_dir).version if model_dir is not None else None
        except Exception:
            return None


class Registry:
    """The models being served, by name and version, and why the others are not.

    Loaded models are immutable snapshots; loading a version builds and warms a new one beside the
    ones serving, then `install` puts it in with one assignment. A request holds the snapshot it
    resolved, so a swap never disturbs it, and a retired snapshot drains by itself."""

    def __init__(self, models: dict[str, LoadedModel], broken: dict[str, str] | None = None,
                 loader: Loader | None = None):
        # name -> {version: snapshot}, newest last
        self.versions: dict[str, dict[int, LoadedModel]] = {m.name: {m.config.version: m} for m in models.values()}
        self.broken = broken or {}  # name -> why it is not served (nothing else is)
        self.failed: dict[tuple[str, int], str] = {}  # (name, version) -> why its last load failed
        self.loader = loader

    def get(self, name: str, version: int | None = None) -> LoadedModel | None:
        versions = self.versions.get(name)
        if not versions:
            return None
        return versions[max(versions)] if version is None else versions.get(version)

    def names(self) -> list[str]:
        return sorted(name for name, versions in self.versions.items() if versions)

    def loaded_versions(self, name: str) -> list[int]:
        return sorted(self.versions.get(name, {}))

    def install(self, model: LoadedModel, keep: int) -> list[LoadedModel]:
        """Serve `model` (newer versions win), keeping the `keep` newest loaded versions; returns the
        snapshots retired. One assignment: a request sees the old set or the new one."""
        versions = dict(self.versions.get(model.name, {}))
        versions[model.config.version] = model
        kept = sorted(versions)[-keep:]
        retired = [versions[v] for v in versions if v not in kept]
        self.versions = {**self.versions, model.name: {v: versions[v] for v in kept}}
        self.broken.pop(model.name, None)
        self.failed.pop((model.name, model.config.version), None)
        return retired

    def remove(self, name: str) -> list[LoadedModel]:
        """Stop serving `name`; returns the snapshots retired."""
        retired = list(self.versions.get(name, {}).values())
        self.versions = {n: v for n, v in self.versions.items() if n != name}
        return retired

    def index(self) -> list[dict[str, Any]]:
        """Every model of the repository folder with its versions and their states: READY (served),
        UNAVAILABLE (its last load failed; the reason) or "" (not loaded)."""
        rows = []
        repository = self.loader.repository if self.loader else None
        names = set(self.versions) | set(self.broken)
        if repository is not None and repository.is_dir():
            names |= {d.name for d in list_models(repository)}
        for name in sorted(names):
            on_disk = list_versions(repository / name) if repository and (repository / name).is_dir() else []
            for version in sorted(set(on_disk) | set(self.versions.get(name, {}))):
                if version in self.versions.get(name, {}):
                    rows.append({"name": name, "version": str(version), "state": "READY", "reason": ""})
                elif (name, version) in self.failed:
                    rows.append({"name": name, "version": str(version), "state": "UNAVAILABLE",
                                 "reason": self.failed[(name, version)]})
                else:
                    rows.append({"name": name, "version": str(version), "state": "", "reason": ""})
            if not on_disk and name in self.broken and name not in self.versions:
                rows.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": self.broken[name]})
        return rows

    @classmethod
    def load(cls, repository: Path, device: str, intra_op_threads: int, cuda_tf32: bool = False,
             warmup: bool = True, skip_broken: bool = False) -> Registry:
        """Load and warm up every model. A model that cannot be served stops the load with a
        StartupError (one line: which model, what is wrong), or with `skip_broken` is left out
        and named in `broken`; a repository with nothing to serve is always an error."""
        if not repository.is_dir():
            raise StartupError(f"model repository {repository} does not exist (run `python -m export`)")
        dirs = list_models(repository)
        if not dirs:
            raise StartupError(f"model repository {repository} has no models (run `python -m export`)")
        loader = Loader(repository, device, intra_op_threads, cuda_tf32, warmup)
        models: dict[str, LoadedModel] = {}
        broken: dict[str, str] = {}
        for model_dir in dirs:
            try:
                model = loader.load(model_dir.name)
            except StartupError as e:
                if not skip_broken:
                    raise
                broken[model_dir.name] = str(e)
                log.error("skipping model %s: %s", model_dir.name, e)
                continue
            models[model.name] = model
        if not models:
            raise StartupError(f"no model of {repository} can be served: " + "; ".join(broken.values()))
        return cls(models, broken, loader)
