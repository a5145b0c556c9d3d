"""ONNX Runtime sessions, one per model of the repository. Knows nothing of HTTP.

A session is checked against its config.json (sha256 of the file, input and output names,
dtypes and shapes) before it is used, and warmed up before the service reports ready.

Which file: a session on the CPU execution provider runs the model's CPU graph where config.json has
one (`variants["cpu"]`: ONNX's `Attention` operator, export.fused), every other session model.onnx.
ONNX Runtime's CUDA kernel of `Attention` cannot return the weights (NOT_IMPLEMENTED), so the CPU graph
is never offered to CUDA. Beside it, the graph without the weights of the provider that runs, where
config.json names one, for the batches that return none: `variants["cpu_outputs"]` on the CPU,
`variants["cuda_outputs"]` on CUDA (its `Attention` on CUDA's fused kernels, which write no score matrix).
That is the fixed choice. Where the warm-up times the graphs (ATTEND_GRAPH_TIMING_S), the other graphs
of the version are opened beside them, and each batch runs the fastest for its size on this machine
(service.core.choice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from export.repository import (
    CONFIG_FILE,
    NAME_RULE,
    ModelConfig,
    TensorSpec,
    list_models,
    list_versions,
    one_head_axis,
    read_config,
    valid_name,
)
from export.repository import model_dir as folder_of
from service.core import denormals
from service.core.choice import (
    Graph,
    Ladder,
    SharedTimings,
    Timings,
    describe_ladders,
    fixed_choice,
    give_back_arena,
    pick,
    warm_up,
)
from service.core.choice import describe as describe_choice
from service.core.sessions import (  # noqa: F401  (CPU, CUDA, StartupError: named here too)
    CPU,
    CUDA,
    StartupError,
    cannot_read,
    check_file,
    check_signature,
    open_session,
    preload_cuda,
    providers_for,
    without_paths,
)
from service.core.statistics import ModelStatistics

log = logging.getLogger("service")

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
    # Every graph a batch may run (service.core.choice), the two above first; and which runs a batch, by whether
    # it returns the weights and by its size.
    graphs: list[Graph] = dataclasses.field(default_factory=list, repr=False, compare=False)
    choice: dict[bool, Ladder] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    timings: Timings | None = dataclasses.field(default=None, repr=False, compare=False)  # the warm-up's
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
    stamp: Stamp | None = dataclasses.field(default=None, repr=False, compare=False)  # the files it was loaded from

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
        return self.head_axis_of(self.session)

    def head_axis_of(self, session: ort.InferenceSession) -> str | None:
        declared = {s.name: s.shape for s in self.outputs}
        return next((o.name for o in session.get_outputs() if o.name in declared
                     and one_head_axis(list(o.shape), declared[o.name])), None)

    def graph(self, session: ort.InferenceSession, file: str, provider: str, linear: bool = False) -> Graph:
        """`session` (on `file` of this version) as a graph a batch may run."""
        names = [o.name for o in session.get_outputs()]
        return Graph(file, provider, session, names, "attention_weights" in names, self.head_axis_of(session), linear)

    def run(self, feed: dict[str, np.ndarray], weights: bool = True, elements: int | None = None
            ) -> dict[str, np.ndarray]:
        """Every output of the graph that runs a batch of this size (`elements`: its inputs' and outputs', from
        the feed where not given): `outputs`, `attention_weights` unless `weights` is False, `P` for the
        positional encoding. Thread-safe: ORT allows concurrent Run on one session (and a RunOptions is
        only read by it). ONNX Runtime's public API, with a RunOptions given (ORT makes one a call
        otherwise): `python bench/ort_call.py` weighs it against the private session's run and IO binding."""
        return self.graph_for(weights, self.elements_of(feed) if elements is None else elements).run(feed, weights)

    def graph_for(self, weights: bool, elements: int) -> Graph:
        """The graph that runs a batch that returns the weights (or not) of `elements` elements."""
        ladder = self.choice[weights]
        return ladder[0][1] if len(ladder) == 1 else pick(ladder, elements)

    @functools.cached_property
    def _output_terms(self) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
        """Each output's fixed sizes' product, and where each of its named axes is read in the inputs."""
        where = {axis: (name, i) for name, named in reversed(self.named_input_axes) for i, axis in named}
        return [(math.prod(d for d in spec.shape if d.__class__ is int),
                 tuple(where[d] for d in spec.shape if d.__class__ is str)) for spec in self.outputs]

    def elements_of(self, feed: dict[str, np.ndarray]) -> int:
        """A run's elements, its inputs' and outputs' (the weights counted, returned or not), as a Job counts them."""
        total = sum([a.size for a in feed.values()])
        for fixed, reads in self._output_terms:
            for name, i in reads:
                fixed *= feed[name].shape[i]
            total += fixed
        return total

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
            # What a batch that returns no weights runs without timing, where it is another graph (else model_file).
            "model_file_without_weights": self.model_file_without_weights or None,
            # What runs a batch, by whether it returns the weights and by its size; and the warm-up's times.
            "graphs": describe_choice(self.choice),
            "graph_timings": self.timings.describe() if self.timings is not None else None,
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


def load_model(model_dir: Path, providers: list[Any], intra_op_threads: int, require_cuda: bool,
               version: int | None = None, candidates: bool = False) -> LoadedModel:
    """A session for the model's newest version (or `version`), checked against its config.json: on the
    CPU graph where only the CPU execution provider is asked for, or where CUDA was asked for and ONNX
    Runtime fell back to the CPU; on model.onnx otherwise; beside it, one on the graph without the weights
    for that provider, where there is one; with `candidates`, the CPU execution provider's sessions of the
    CPU's graphs and of model.onnx besides (service.core.choice times them all). Every file config.json names
    must have the sha256 it names, the ones not served too: a version is served whole or not at all. Errors
    name files relative to the repository: they reach clients (GET /models, the load route)."""
    shown = f"{model_dir.name}/{version}" if version is not None else model_dir.name
    try:
        config = read_config(model_dir, version)
        portable, cpu_graph = config.graph_for(cpu=False), config.graph_for(cpu=True)
        without_weights = config.graph_without_weights() if cpu_graph != portable else None
        cuda_without_weights = config.graph_without_weights(cpu=False)
    except Exception as e:
        raise StartupError(f"model {shown}: unreadable config.json: {without_paths(str(e), model_dir)}") from e
    for graph in dict.fromkeys(g for g in (portable, cpu_graph, without_weights, cuda_without_weights)
                               if g is not None):
        check_file(model_dir, config, graph)
    # A provider given with options is a tuple (CUDA's): only a plain "CPUExecutionProvider" is the CPU.
    graph = cpu_graph if all(p == CPU for p in providers) else portable
    session, cuda_failure = open_session(model_dir, config, graph, intra_op_threads, providers)
    # ORT falls back to the CPU silently when CUDA cannot load: report what really runs.
    provider = session.get_providers()[0]
    if require_cuda and provider != CUDA:
        raise StartupError(f"ATTEND_DEVICE=cuda but CUDA cannot be used ({cuda_failure}); it needs an NVIDIA GPU "
                           "and driver, CUDA 13 and cuDNN 9 (pip install 'onnxruntime-gpu[cuda,cudnn]')")
    if provider == CPU and graph != cpu_graph:
        # CUDA was asked for and ONNX Runtime fell back to the CPU: the CPU's graph, on the CPU alone.
        graph = cpu_graph
        session, _ = open_session(model_dir, config, graph, intra_op_threads, [CPU])
    model = LoadedModel(config=config, session=session, provider=provider, cuda_failure=cuda_failure,
                        model_file=graph[0], sha256=graph[1], opset=graph[2])
    check_signature(model)
    # On the CPU the session runs the CPU graph (or model.onnx, where there is none: then no graph without weights).
    outputs_graph = cuda_without_weights if provider == CUDA else without_weights
    if outputs_graph is not None:
        outputs_session, _ = open_session(model_dir, config, outputs_graph, intra_op_threads,
                                   providers if provider == CUDA else [CPU])
        if outputs_session.get_providers()[0] != provider:
            raise StartupError(f"model {config.name}: {model_dir.name}/{outputs_graph[0]} does not load on "
                               f"{provider}, which runs {model_dir.name}/{graph[0]}")
        model.session_without_weights, model.model_file_without_weights = outputs_session, outputs_graph[0]
        check_signature(model, outputs_session)
    model.graphs.append(model.graph(session, graph[0], provider))
    if model.session_without_weights is not None:
        model.graphs.append(model.graph(model.session_without_weights, model.model_file_without_weights, provider,
                                        linear=provider == CUDA))
    if candidates:
        opened = {(g.file, g.provider) for g in model.graphs}
        for other in dict.fromkeys(g for g in (cpu_graph, without_weights, portable) if g is not None):
            if (other[0], CPU) not in opened:
                cpu_session, _ = open_session(model_dir, config, other, intra_op_threads, [CPU])
                check_signature(model, cpu_session, weights=other != without_weights)
                model.graphs.append(model.graph(cpu_session, other[0], CPU))
    model.choice = fixed_choice(model.graphs, "attention_weights" in model.output_names)
    return model


# What a model's newest version is on disk: its config.json, and the size and modification time of every file it
# names. A version changed in place (files copied over it, a copy that finished) has a new stamp.
Stamp = tuple[ModelConfig, tuple[tuple[str, int, int], ...]]


def stamp_of(model_dir: Path) -> Stamp | None:
    """The stamp of the model's newest version, or None where it cannot be read."""
    try:
        config = read_config(model_dir)
        files = [f for f in (config.model_file, *(v["file"] for v in config.variants.values())) if f]
        return config, tuple((f, (stat := (model_dir / f).stat()).st_size, stat.st_mtime_ns) for f in files)
    except Exception:  # not there, not readable, not a config: the load says why
        return None


@dataclass
class Loader:
    """How sessions are made: the same for start-up and for every load while serving."""

    repository: Path
    device: str
    intra_op_threads: int
    cuda_tf32: bool = False
    warmup: bool = True
    graph_timing_s: float = 0.0  # the warm-up's time to choose among a model's graphs; 0: the fixed choice
    flush_denormals: bool = True  # service.core.denormals
    shared: SharedTimings | None = None  # ATTEND_WORKERS: the graphs' times of every process of the start
    # The stamp of each model whose last load of its newest version failed: the poll tries it again once it changed.
    failed_stamps: dict[str, Stamp | None] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        denormals.enabled = self.flush_denormals
        if self.device != "cpu":
            preload_cuda()
        self.providers = providers_for(self.device, self.cuda_tf32)

    def load(self, name: str, version: int | None = None) -> LoadedModel:
        """Load, check and warm up `name` (its newest version, or `version`). StartupError when it
        cannot be served, with the reason."""
        model_dir = folder_of(self.repository, name)
        if model_dir is None and valid_name(name):  # a link the operator made, out of the repository
            raise StartupError(f"model {name}: its folder links out of the repository; a model's folder must be "
                               "inside it (copy the folder in, or make the repository itself the link)")
        if model_dir is None:
            raise StartupError(f"{name!r} is not a model's name: a name is {NAME_RULE}")
        try:
            if not (model_dir / CONFIG_FILE).is_file():
                raise StartupError(f"model {name}: no such model in the repository (no {name}/{CONFIG_FILE})")
        except OSError as e:
            raise StartupError(f"model {name}: {cannot_read(f'{name}/{CONFIG_FILE}', e)}") from None
        stamp = stamp_of(model_dir)  # before the files are read: a change while they are is seen at the next poll
        try:
            model = self._load(model_dir, name, version)
        except StartupError:
            if version is None:
                self.failed_stamps[name] = stamp
            raise
        self.failed_stamps.pop(name, None)
        model.stamp = stamp if model.config == (stamp[0] if stamp else None) else None
        return model

    def _load(self, model_dir: Path, name: str, version: int | None) -> LoadedModel:
        start = time.perf_counter()
        timing = self.graph_timing_s if self.warmup else 0.0
        model = load_model(model_dir, self.providers, self.intra_op_threads, require_cuda=self.device == "cuda",
                           version=version, candidates=timing > 0)
        if self.warmup:
            try:
                warm_up(model, timing, self.shared)
            except Exception as e:  # warm-up failing is the model's fault too
                raise StartupError(f"model {name}: warm-up failed: {without_paths(str(e), model_dir)}") from e
        if self.device == "auto" and model.provider != CUDA and CUDA in str(self.providers):
            # Tried once, fell back: spare the other models the same failed attempt.
            log.warning("no CUDA here (%s): the CPU execution provider serves every model", model.cuda_failure)
            self.providers = [CPU]
        log.info("loaded model %s (%s, version %d, %s) on %s in %.2fs", model.name, model.kind, model.config.version,
                 model.model_file, model.provider, time.perf_counter() - start)
        if model.timings is not None:
            log.info("model %s runs %s%s", model.name, describe_ladders(model.choice),
                     " (timed by another process)" if model.timings.adopted else "")
        return model

    def stamp(self, name: str) -> Stamp | None:
        model_dir = folder_of(self.repository, name)
        return stamp_of(model_dir) if model_dir is not None else None

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

    def shrink_arena(self) -> None:
        """The CPU arena's free regions back to the system, by a run of one served model (choice.give_back_arena)."""
        model = next((m for versions in list(self.versions.values()) for m in list(versions.values())), None)
        if model is not None:
            give_back_arena(model)

    def loaded_versions(self, name: str) -> list[int]:
        return sorted(self.versions.get(name, {}))

    def install(self, model: LoadedModel, keep: int) -> list[LoadedModel]:
        """Serve `model` (newer versions win), keeping the `keep` newest loaded versions; returns the
        snapshots retired. One assignment: a request sees the old set or the new one."""
        versions = dict(self.versions.get(model.name, {}))
        replaced = versions.get(model.config.version)  # the same version, changed in place on disk
        versions[model.config.version] = model
        kept = sorted(versions)[-keep:]
        retired = [versions[v] for v in versions if v not in kept] + ([replaced] if replaced else [])
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
            with contextlib.suppress(OSError):  # unreadable now: what is loaded, and what failed
                names |= {d.name for d in list_models(repository)}
        for name in sorted(names):
            folder = folder_of(repository, name) if repository else None  # None: a link out of the repository
            try:
                on_disk = list_versions(folder) if folder and folder.is_dir() else []
            except OSError:  # not readable by the service: its reason is its failed load's
                on_disk = []
            for version in sorted(set(on_disk) | set(self.versions.get(name, {}))):
                if version in self.versions.get(name, {}):
                    # READY with a reason: its files changed in place, and what they are now did not load.
                    failed = self.failed.get((name, version))
                    reason = f"serving the files loaded before; those on disk now did not load: {failed}" if failed \
                        else ""
                    rows.append({"name": name, "version": str(version), "state": "READY", "reason": reason})
                elif (name, version) in self.failed:
                    rows.append({"name": name, "version": str(version), "state": "UNAVAILABLE",
                                 "reason": self.failed[(name, version)]})
                else:
                    rows.append({"name": name, "version": str(version), "state": "", "reason": ""})
            reason = self.broken.get(name) or self.failed.get((name, 0))  # 0: no version could be read
            if not on_disk and reason and name not in self.versions:
                rows.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": reason})
        return rows

    @classmethod
    def load(cls, repository: Path, device: str, intra_op_threads: int, cuda_tf32: bool = False,
             warmup: bool = True, skip_broken: bool = False, graph_timing_s: float = 0.0,
             flush_denormals: bool = True, timings_folder: str | None = None) -> Registry:
        """Load and warm up every model. A model that cannot be served stops the load with a
        StartupError (one line: which model, what is wrong), or with `skip_broken` is left out
        and named in `broken`; a repository with nothing to serve is always an error. `graph_timing_s`:
        Loader's (the service's setting is ATTEND_GRAPH_TIMING_S; this default, the fixed choice).
        `timings_folder`: where the processes of one start share the graphs' times (Loader.shared)."""
        if repository.exists() and not repository.is_dir():
            raise StartupError(f"model repository {repository} is a file, not a folder (ATTEND_MODEL_REPOSITORY)")
        if not repository.is_dir():
            raise StartupError(f"model repository {repository} does not exist (run `python -m export`)")
        try:
            dirs = list_models(repository)
        except OSError as e:
            raise StartupError(f"model repository {cannot_read(str(repository), e)}") from None
        if not dirs:
            raise StartupError(f"model repository {repository} has no models (run `python -m export`)")
        loader = Loader(repository, device, intra_op_threads, cuda_tf32, warmup, graph_timing_s, flush_denormals,
                        SharedTimings(timings_folder) if timings_folder else None)
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
        registry = cls(models, broken, loader)
        for name, reason in broken.items():  # tried: SIGHUP and the poll wait for a new version
            registry.failed[(name, loader.newest(name) or 0)] = reason
        return registry
