"""Which of a model version's graphs runs a batch: per model and range of sizes, the fastest of those it has,
timed at warm-up on the machine it runs on (`warm_up`, ATTEND_GRAPH_TIMING_S).

The candidates (service.core.runtime.load_model opens them): for a batch that returns the weights, the graphs
that give them; for one that returns none, every graph. On the CPU: model.cpu.onnx, model.onnx, and for no
weights model.cpu.outputs.onnx. On CUDA: model.onnx, and for no weights model.cuda.outputs.onnx; beside
them the CPU execution provider's sessions of the CPU's graphs, since a small run costs less on the CPU than
CUDA's launches and costs the shared GPU nothing.

`time_graphs` runs the candidates on a ladder of sizes (batch 1, n = 4, 8, 16, ...: n doubles a rung), each
the fastest of a few calls in turn. The bound: ATTEND_GRAPH_TIMING_S a model (the next rung runs where its
predicted time fits in what is left; the first two always run), and no rung past _MAX_WEIGHTS weights
(the warm-up's scores must not fill a GPU that several workers share). A candidate several times slower
than its ladder's fastest and falling further behind, or failing (out of memory), is timed no further, and so
is the last one left. The lengths are random, one an example, so that masked keys cost what they cost (on an
Intel CPU with AVX-512 they cost most: `python bench/underflow.py`).

`choose` turns the times into a ladder of graphs by size: each candidate at most once, in the order of the sizes
it wins (the sequence that loses least against each rung's fastest, a change of graph counted as a loss of
_SWITCH_COST); where the winner changes between two rungs, the threshold is where the lines through their
times cross. Past the largest rung: where a graph keeps no scores (CUDA's fused one, without the weights),
it runs every larger batch, since there memory decides; elsewhere each line through its two largest points
goes on, and one more graph takes over where its line crosses below. A size is a run's elements, inputs and
outputs, as RunCost counts them (the weights counted whether they are returned or not).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from export.repository import example_feed, without_head_axis
from service.core import denormals
from service.core.sessions import CPU, CUDA, shrink_arena

if TYPE_CHECKING:
    from service.core.runtime import LoadedModel

log = logging.getLogger("service")
_RUN_OPTIONS = ort.RunOptions()
UNBOUNDED = sys.maxsize  # the last graph of a ladder: every size from its threshold on
_FEATURES = 32  # the ladder's free feature sizes (dot_product's d and value size, additive's value size)
_MAX_WEIGHTS = 1 << 26  # the largest rung's weights (batch x heads x n_q x n_k): n = 8192 for one head
_ROUNDS = 5  # timed calls of each candidate a rung, the fastest kept
# A candidate this many times its ladder's fastest, on the same provider, and drifting away (its ratio grew by
# half since the rung before), is timed no further; one that keeps pace, or runs on another provider (a CUDA
# session's fixed cost beside the CPU's small runs), is timed on, since it may catch up.
_HOPELESS = 4.0
_DRIFTING = 1.5
# A change of graph must save this much of the time summed over the rungs it covers (log ratio): graphs within
# a machine's noise of each other keep one graph.
_SWITCH_COST = math.log(1.10)


@dataclass(eq=False)
class Graph:
    """One session on one file of a model version: what a batch may run."""

    file: str  # relative to the model's folder
    provider: str
    session: ort.InferenceSession
    names: list[str]  # its outputs, config.json's names (attention_weights where it gives them)
    weights: bool  # it gives attention_weights
    head_axis: str | None = None  # the output it gives with an axis of its one head (viewed away)
    linear: bool = False  # it keeps no score matrix where the lengths are one an example: its memory is linear
    runs: int = 0  # batches it ran (counted without a lock: a statistic)

    def run(self, feed: dict[str, np.ndarray], weights: bool = True) -> dict[str, np.ndarray]:
        """Its outputs by name; without attention_weights unless `weights` (ORT copies none out then)."""
        self.runs += 1
        names = self.names if weights or not self.weights else self.names_without_weights
        outputs = dict(zip(names, denormals.run(self.session.run, names, feed, _RUN_OPTIONS), strict=True))
        if self.head_axis is not None and self.head_axis in outputs:  # as config.json declares it: a view
            outputs[self.head_axis] = without_head_axis(outputs[self.head_axis])
        return outputs

    @functools.cached_property
    def names_without_weights(self) -> list[str]:
        return [name for name in self.names if name != "attention_weights"]

    @property
    def label(self) -> str:
        return f"{self.file} on {'CUDA' if self.provider == CUDA else 'CPU'}"


Ladder = tuple[tuple[int, Graph], ...]  # (the largest size it runs, graph), sizes growing; the last UNBOUNDED


def pick(ladder: Ladder, elements: int) -> Graph:
    for up_to, graph in ladder:
        if elements <= up_to:
            return graph
    return ladder[-1][1]


def candidates(graphs: Sequence[Graph], weights: bool, has_weights: bool) -> list[Graph]:
    """The graphs a batch may run: those that give the weights where it returns them (and the model has any)."""
    return [g for g in graphs if g.weights or not weights or not has_weights]


Entry = tuple[Graph, bool]  # a graph, and whether its weights are fetched (False: not, or it has none)


@dataclass
class Timings:
    """The warm-up's ladder: each rung's elements, and each entry's fastest ms there (inf: not timed)."""

    elements: list[int]
    ms: dict[Entry, list[float]]
    adopted: bool = False  # measured by another process (`adopt`)

    def describe(self) -> list[dict[str, Any]]:
        return [{"elements": e, "ms": {label(entry): round(t[i], 4) for entry, t in self.ms.items()
                                       if t[i] != math.inf}} for i, e in enumerate(self.elements)]

    def export(self) -> Exported:
        """The times without the sessions: for another process of the same model version (`adopt`)."""
        return self.elements, [(g.file, g.provider, fetched, t) for (g, fetched), t in self.ms.items()]


# Timings as another process takes them: the rungs' elements, and (file, provider, weights fetched, ms) an entry.
Exported = tuple[list[int], list[tuple[str, str, bool, list[float]]]]


def adopt(exported: Exported, graphs: Sequence[Graph], has_weights: bool) -> Timings | None:
    """Timings another process measured on these graphs' files, as this process's sessions' (None where they
    are not what `time_graphs` would measure here: other graphs, another version's)."""
    wanted = {(g.file, g.provider, fetched): (g, fetched) for weights in (True, False)
              for g, fetched in entries(graphs, weights, has_weights)}
    elements, rows = exported
    if {tuple(row[:3]) for row in rows} != set(wanted) or any(len(t) != len(elements) for *_, t in rows):
        return None
    return Timings(list(elements), {wanted[tuple(row[:3])]: list(row[3]) for row in rows}, adopted=True)


@dataclass(frozen=True)
class SharedTimings:
    """The graphs' times of the processes of one start (ATTEND_WORKERS: the start's check and every worker), a
    file a model version in a folder of the start's own. The first process to load a version times its graphs
    while it holds the version's lock, and every other one takes its times: all choose alike, and none times
    while another does (two workers timing at once on a 2-core Xeon chose different ladders)."""

    folder: str | os.PathLike[str]

    @contextlib.contextmanager
    def turn(self, key: str) -> Iterator[Exported | None]:
        """The times stored under `key`; or None, and then the lock of `key` is held until the block ends, in which
        the caller times the graphs and `store`s their times (a folder it cannot use: None, and no lock)."""
        path = self._path(key)
        if (given := _read(path)) is not None:  # no lock to read: a file is replaced whole (`store`)
            yield given
            return
        try:
            lock = open(f"{path}.lock", "a")  # noqa: SIM115 (held past the block's first lines)
        except OSError as e:
            log.warning("graphs' times not shared (%s): this process times its own", e.strerror)
            yield None
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes, or with the process that holds it
            yield _read(path)

    def store(self, key: str, exported: Exported) -> None:
        path = self._path(key)
        try:
            with open(f"{path}.part", "w") as f:
                json.dump(exported, f)
            os.replace(f"{path}.part", path)
        except OSError as e:
            log.warning("graphs' times not shared (%s): the other processes time their own", e.strerror)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _read(path: str) -> Exported | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet (or unreadable: then `turn`'s lock and own timing)
        return None


def label(entry: Entry) -> str:
    graph, weights = entry
    return graph.label + (" without weights" if graph.weights and not weights else "")


def entries(graphs: Sequence[Graph], weights: bool, has_weights: bool) -> list[Entry]:
    """What to time for batches that return the weights, or not: each candidate as such a batch runs it."""
    return [(g, weights and g.weights) for g in candidates(graphs, weights, has_weights)]


def ladder_feed(model: LoadedModel, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A batch of one at n queries and keys, the free features at _FEATURES, random lengths (one an example)."""
    sizes = {"batch": 1, "n_q": n, "n_k": n, "n": n, "d": _FEATURES, "value_size": _FEATURES}
    feed = example_feed(model.kind, model.config.hyperparameters, sizes, rng)
    lens = feed.get("valid_lens")
    if lens is not None:
        feed["valid_lens"] = np.repeat(rng.integers(1, n + 1, size=(lens.shape[0], 1)), lens.shape[1], axis=1)
    return feed


def _rungs(model: LoadedModel) -> list[int]:
    heads = int(model.config.hyperparameters.get("num_heads", 1))
    longest = int(model.config.hyperparameters.get("max_len") or sys.maxsize)
    rungs, n = [], 4
    while n <= longest and heads * n * n <= _MAX_WEIGHTS:
        rungs.append(n)
        n *= 2
    return rungs


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def time_graphs(model: LoadedModel, budget_s: float, rng: np.random.Generator | None = None) -> Timings:
    """Every graph of `model` timed on the ladder of sizes, within about `budget_s` (see the module's docstring).
    A candidate is timed while two or more of its ladder's are still in the race (_HOPELESS, _DRIFTING)."""
    rng = rng or np.random.default_rng(0)
    has_weights = "attention_weights" in model.output_names
    pools = [entries(model.graphs, weights, has_weights) for weights in (True, False)]
    timed = list(dict.fromkeys(entry for pool in pools for entry in pool))
    timings = Timings([], {entry: [] for entry in timed})
    alive = list(timed)
    behind: dict[Entry, float] = {}  # each one's time over its ladder's fastest at the last rung
    began = time.perf_counter()
    last = 0.0  # seconds the last rung took
    for n in _rungs(model):
        feed = ladder_feed(model, n, rng)
        elements = model.elements_of(feed)
        if timings.elements:
            growth = elements / timings.elements[-1]
            if len(timings.elements) >= 2 and time.perf_counter() - began + 1.5 * growth * last > budget_s:
                break
        start = time.perf_counter()
        calls = {entry: _call(entry, feed) for entry in alive}
        best: dict[Entry, float] = {}
        for entry, call in calls.items():
            try:
                call()  # untimed: allocation, and CUDA's first launches at a shape
            except Exception:  # out of memory, typically: it runs nothing this large
                continue
            best[entry] = math.inf
        for round_ in range(_ROUNDS):
            order = list(best)
            turn = round_ % max(len(order), 1)
            for entry in order[turn:] + order[:turn]:
                best[entry] = min(best[entry], _timed(calls[entry]))
        if not best:
            break
        timings.elements.append(elements)
        for entry in timed:
            timings.ms[entry].append(best.get(entry, math.inf))
        alive = []
        for pool in pools:
            left = [entry for entry in pool if entry in best]
            fastest = min((best[entry] for entry in left), default=math.inf)
            leader = next((entry[0].provider for entry in left if best[entry] == fastest), None)
            ratios = {entry: best[entry] / fastest for entry in left}
            # A graph on another provider than the fastest's is timed on whatever its ratio: a GPU's fixed cost
            # a run can look hopeless beside the CPU's small runs, and one rung's noise can look like drifting.
            left = [entry for entry in left if ratios[entry] <= _HOPELESS or entry[0].provider != leader
                    or ratios[entry] < _DRIFTING * behind.get(entry, math.inf)]
            behind.update(ratios)
            alive += left if len(left) > 1 else []
        alive = list(dict.fromkeys(alive))
        if not alive:
            break
        last = time.perf_counter() - start
    return timings


def _call(entry: Entry, feed: dict[str, np.ndarray]) -> Callable[[], object]:
    graph, weights = entry
    names = graph.names if weights or not graph.weights else graph.names_without_weights

    def call() -> object:
        return denormals.run(graph.session.run, names, feed, _RUN_OPTIONS)

    return call


def choose(timings: Timings, pool: Sequence[Graph], weights: bool) -> Ladder:
    """The ladder of graphs by size that `timings` make fastest among `pool` for batches that return the
    weights or not (see the module's docstring)."""
    rungs = len(timings.elements)
    if rungs == 0 or len(pool) == 1:
        return ((UNBOUNDED, pool[0]),)
    ms = {g: timings.ms[(g, weights and g.weights)] for g in pool}
    elements = list(timings.elements)
    pinned = any(g.linear for g in pool)
    if pinned:  # past the ladder, memory decides: the graph that keeps no scores (a rung after the last)
        elements.append(elements[-1] + 1)
        ms = {g: [*t, 1.0 if g.linear else math.inf] for g, t in ms.items()}
        rungs += 1
    fastest = [min(t[r] for t in ms.values()) for r in range(rungs)]

    def cost(g: Graph, r: int) -> float:
        return math.log(ms[g][r] / fastest[r]) if ms[g][r] != math.inf and fastest[r] > 0 else math.inf

    # The best sequence of graphs, each in one run of rungs: (total cost, graphs used, sequence) by last graph.
    states: dict[tuple[Graph, frozenset], tuple[float, list[Graph]]] = {
        (g, frozenset([g])): (cost(g, 0), [g]) for g in pool}
    for r in range(1, rungs):
        nxt: dict[tuple[Graph, frozenset], tuple[float, list[Graph]]] = {}
        for (last, used), (total, path) in states.items():
            for g in pool:
                if g is not last and g in used:
                    continue
                key = (g, used | {g})
                value = total + cost(g, r) + (0.0 if g is last else _SWITCH_COST)
                if key not in nxt or value < nxt[key][0]:
                    nxt[key] = (value, [*path, g])
        states = nxt
    path = min(states.values(), key=lambda s: s[0])[1]
    ladder: list[tuple[int, Graph]] = []
    for r in range(rungs - 1):
        if path[r + 1] is not path[r]:
            ladder.append((_crossing(elements, ms[path[r]], ms[path[r + 1]], r), path[r]))
    last = path[-1]
    beyond = None if pinned else _beyond(elements, ms, last, set(path))
    if beyond is not None:
        ladder.append((beyond[0], last))
        last = beyond[1]
    ladder.append((UNBOUNDED, last))
    return tuple(ladder)


def _crossing(elements: list[int], a: list[float], b: list[float], r: int) -> int:
    """Where `a`'s line crosses `b`'s between rungs r and r + 1 (r's elements where they do not cross there)."""
    before, after = a[r] - b[r], a[r + 1] - b[r + 1]
    if before < 0 < after and math.isfinite(after):
        return int(elements[r] + (elements[r + 1] - elements[r]) * -before / (after - before))
    return elements[r]


def _beyond(elements: list[int], ms: dict[Graph, list[float]], last: Graph, used: set[Graph]
            ) -> tuple[int, Graph] | None:
    """Past the largest rung: the first graph not used yet whose line through its two largest points crosses
    below `last`'s, and where."""
    if len(elements) < 2:
        return None
    span = elements[-1] - elements[-2]

    def line(t: list[float]) -> tuple[float, float]:
        return (t[-1] - t[-2]) / span, t[-1]

    slope, at = line(ms[last])
    found: tuple[int, Graph] | None = None
    for graph, t in ms.items():
        if graph in used or not (math.isfinite(t[-1]) and math.isfinite(t[-2])):
            continue
        s, y = line(t)
        if s < slope and math.isfinite(slope):
            cross = elements[-1] + max(int((y - at) / (slope - s)), 0)
            if found is None or cross < found[0]:
                found = (cross, graph)
    return found


def fixed_choice(graphs: Sequence[Graph], has_weights: bool) -> dict[bool, Ladder]:
    """The choice without timing: the first graph that gives the weights for every batch that returns them, and
    for one that returns none the first graph without them on the same provider (else the same)."""
    first = graphs[0]
    outputs = next((g for g in graphs if not g.weights and g.provider == first.provider), first) \
        if has_weights else first
    return {True: ((UNBOUNDED, first),), False: ((UNBOUNDED, outputs),)}


def timed_choice(model: LoadedModel, budget_s: float, shared: SharedTimings | None = None) -> dict[bool, Ladder]:
    """Time the model's graphs and choose (`model.timings` keeps the times); or choose by the times another
    process of the start measured on the same graphs (`shared`), and share them where it measured them."""
    has_weights = "attention_weights" in model.output_names
    key = timings_key(model)
    with shared.turn(key) if shared else contextlib.nullcontext() as given:
        model.timings = (given is not None and adopt(given, model.graphs, has_weights)) or time_graphs(model, budget_s)
        if shared and given is None:
            shared.store(key, model.timings.export())
    return {weights: choose(model.timings, candidates(model.graphs, weights, has_weights), weights)
            for weights in (True, False)}


def timings_key(model: LoadedModel) -> str:
    """A model version, as the times of its graphs are shared (`adopt` checks they are of its graphs)."""
    return f"{model.name} {model.config.version} {model.sha256}"


def describe(choice: dict[bool, Ladder]) -> list[dict[str, Any]]:
    """GET /models/{name}'s "graphs": for batches with the weights and without, which graph runs up to which size."""
    return [{"file": g.file, "provider": g.provider, "weights": weights,
             "up_to_elements": None if up_to == UNBOUNDED else up_to, "runs": g.runs}
            for weights in (True, False) for up_to, g in choice[weights]]


def device_steps(model: LoadedModel) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """For the device budget (service.core.jobs): by a job's elements, what a batch with it may hold in the
    execution provider's memory, as the largest of the graphs it may run at its size or any larger (a batch
    only grows): 0 nothing (a CPU session beside CUDA), 1 linear (a graph that keeps no scores), 2 the scores.
    For a job whose lengths are one an example and which returns no weights (its batch is of its like), and
    for any other job."""
    def kind(graph: Graph, linear: bool) -> int:
        if graph.provider == CPU and model.provider == CUDA:
            return 0
        return 1 if graph.linear and linear else 2

    def steps(ladders: list[Ladder], linear: bool) -> tuple[tuple[int, int], ...]:
        bounds = sorted({up_to for ladder in ladders for up_to, _ in ladder})
        worst = [max(kind(g, linear) for ladder in ladders for up_to, g in ladder if up_to >= bound)
                 for bound in bounds]
        return tuple(zip(bounds, worst, strict=True))

    return steps([model.choice[False]], True), steps([model.choice[True], model.choice[False]], False)


def step(steps: tuple[tuple[int, int], ...], elements: int) -> int:
    for up_to, kind in steps:
        if elements <= up_to:
            return kind
    return steps[-1][1]


def describe_ladders(choice: dict[bool, Ladder]) -> str:
    """The choice in one line, for the log."""
    def one(ladder: Ladder) -> str:
        return ", then ".join(g.label + ("" if up_to == UNBOUNDED else f" up to {up_to} elements")
                              for up_to, g in ladder)
    return f"with the weights: {one(choice[True])}; without: {one(choice[False])}"


# The warm-up's sizes: a small request (the book's examples' size), and one with a few hundred times its
# elements (a run several times as long: its difference from the small one is not lost in a loaded
# machine's noise).
_WARM_SIZES = ({"batch": 2, "n_q": 3, "n_k": 4, "n": 3, "d": 8, "value_size": 8},
               {"batch": 16, "n_q": 32, "n_k": 32, "n": 32, "d": 32, "value_size": 32})
_TIMED_RUNS = 7


def give_back_arena(model: LoadedModel) -> None:
    """ONNX Runtime's CPU arena's free regions back to the system (service.core.sessions.shrink_arena), by a run of
    `model` on the warm-up's small example."""
    shrink_arena(model.session, example_feed(model.kind, model.config.hyperparameters, _WARM_SIZES[0],
                                             np.random.default_rng(0)))


def warm_up(model: LoadedModel, graph_timing_s: float = 0.0, shared: SharedTimings | None = None) -> None:
    """Where the model has several graphs and `graph_timing_s` is not 0, times them (or takes their `shared` times)
    and chooses which runs a batch by its size (service.core.choice: about that many seconds). Then runs on
    a small and a larger input, so the first client does not pay for allocation; then each timed a few
    times, the two in turn (a burst of load slows both), the fastest of each kept in `model.run_times`: for
    the batcher to know from the first request what a run of this model costs (a few ms a model). Last, the
    arena's free regions go back to the system."""
    if graph_timing_s > 0 and len(model.graphs) > 1:
        model.choice = timed_choice(model, graph_timing_s, shared)
    rng = np.random.default_rng(0)
    feeds = [example_feed(model.kind, model.config.hyperparameters, sizes, rng) for sizes in _WARM_SIZES]
    elements = []
    for feed in feeds:
        model.run(feed)
        elements.append(model.elements_of(feed))
        model.run(feed, weights=False)  # the graph without the weights, where there is one
    fastest = [float("inf")] * len(feeds)
    for _ in range(_TIMED_RUNS):
        for i, feed in enumerate(feeds):
            start = time.perf_counter()
            model.run(feed, elements=elements[i])
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    model.run_times.extend(zip(elements, fastest, strict=True))
    give_back_arena(model)  # the timing's largest runs: not kept
    for graph in model.graphs:
        graph.runs = 0  # the warm-up's are not the service's
