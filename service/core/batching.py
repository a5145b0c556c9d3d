"""Dynamic batching, a bounded queue, deadlines, and where a session run happens.

Concurrent requests for the same model are merged into one session run, whatever their shapes
where the padding costs less than the runs it saves. Padding is exact:

- along the sequence axes: queries, keys and values are zero-padded to the batch's largest n_q and
  n_k, and every request's 2-D valid lengths (its own; its n_k where it sent none; a 1-D length
  for each of its queries: the graph takes only the 2-D form) are at most its own n_k, so padded
  keys get weight exactly 0; padded query rows repeat their request's last length (a request's lengths
  that are one a row stay so, which spares the CPU graph its mask: export.fused) and are sliced off;
- along the feature sizes a graph leaves free: values' (dot_product, additive: zero columns, sliced
  off the outputs), and dot_product's query and key size d, zero-padded to the batch's largest D
  with each request's queries scaled by sqrt(D / d), so that the graph's 1/sqrt(D) gives the
  book's q.k / sqrt(d). The positional encoding's d is not padded (P depends on it): requests group
  by it.

Each request gets back exactly its own rows, queries, keys and features. Whether a request joins a
batch is a cost: `RunCost`, per model, says what a run costs (a fixed part, and a part per element of
its inputs and outputs, padding included), from the model's warm-up runs and then from every run;
a request joins when the padding it adds costs less than the run of its own it saves, so one long
request does not make many short ones pay for padding.

Where a batch runs (measured on this project's machines, see docs/benchmarks.md): a hop to a worker
thread costs 65 to 90 us, while the book's toy request runs in about 20 us. So a batch whose run is
predicted (`RunCost`) to take less than `inline_run_s` runs right on the event loop; larger ones go
to long-lived inference threads, so the loop keeps reading and decoding requests meanwhile. A
request that is alone in the server (no other in progress) has nothing to overlap with: it runs on
the loop when predicted under `alone_inline_run_s`. (W2 in binary tensors, a ~0.7 ms run, alone at
concurrency 1: 2097 us of server CPU a request through the thread, 1555 us on the loop, measured
A/B: the hop, the batcher's passes of the loop and the GIL's hand-offs.) A batcher is woken by the
first request put in its queue and takes its batch one loop iteration later: the requests that
arrived in the same read of the sockets are decoded and queued by then, so they merge with no
waiting at all.

With batching off the same queue runs batches of one request: the same admission, deadlines
and metrics, no merging.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.cost import answer
from service.core.errors import ClientGone, DeadlineExceeded, Overloaded
from service.core.metrics import Metrics
from service.core.request import Request
from service.core.runtime import LoadedModel

log = logging.getLogger("service")

# (model, one request's outputs by name, whether it asked for the attention weights) -> its response body
Encoder = Callable[[LoadedModel, dict[str, np.ndarray], bool], Any]


@dataclass(frozen=True)
class BatchLimits:
    enabled: bool = True
    max_rows: int = 64  # sum of the requests' batch sizes
    max_elements: int = 4 * 1024 * 1024  # padded rows * heads * n_q * n_k: bounds the weights' memory
    max_wait_s: float = 0.0  # how long the first request waits for others to fill its batch
    max_queue: int = 256  # requests waiting (all models); more get 503 at once
    inline_run_s: float = 1e-3  # batches predicted to run faster than this run on the event loop
    alone_inline_run_s: float = 5e-3  # ... and a request alone in the server, faster than this


# Asking whether a client has gone: under `python -m service` a read of the connection's state (~1 us),
# under another server a cancelled receive (~30 us on the event loop): worth it for a request that has
# waited, not for one that just arrived.
_CHECK_CLIENT_AFTER_S = 0.002
# A batch being gathered waits at most this many times max_wait_s after its oldest request came.
_GATHER_CAP = 5
# A batch is looked for among at most this many requests it leaves queued (too costly to pad, or over
# a limit) besides those it takes: the queue is not searched end to end for every batch.
_PASSED = 64


_SEQUENCE = ("n_q", "n_k", "n")
# The feature sizes that a kind's graph leaves free and a batch may pad (see the module's docstring).
_PADDED_FEATURES = {"dot_product": ("d", "value_size"), "additive": ("value_size",)}


def _fixed_axes(model: LoadedModel) -> frozenset[str]:
    """The named axes a batch cannot pad: its requests have the same size of each."""
    padded = {"batch", *_SEQUENCE, *_PADDED_FEATURES.get(model.kind, ())}
    return frozenset(axis for _, named in model.named_input_axes for _, axis in named if axis not in padded)


class Job:
    """One request in the queue: its future gets the encoded response, or the error.

    `axes` holds the request's size of every named axis of its model's signature (batch, n_q, n_k
    or n, and the free feature sizes); `shape` the same but batch, in the signature's order; `key`
    the sizes no batch pads (requests of one key may merge); `elements` those of its run's inputs
    and outputs (`RunCost`)."""

    __slots__ = ("request", "deadline", "encode", "is_disconnected", "enqueued", "future", "axes", "rows", "n_q",
                 "n_k", "key", "cost", "shape", "elements")

    def __init__(self, request: Request, deadline: float, encode: Encoder | None = None,
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None, future: asyncio.Future | None = None):
        self.request = request
        self.deadline = deadline  # time.monotonic()
        self.encode = encode
        self.is_disconnected = is_disconnected
        self.enqueued = time.monotonic()
        self.future = future
        memo = request.memo  # requests of one layout (service.protocols.attend's plans) share their sizes
        sizes = None if memo is None else memo.get("job sizes")
        if sizes is None:
            sizes = _sizes(request)
            if memo is not None:
                memo["job sizes"] = sizes
        self.axes, self.rows, self.n_q, self.n_k, self.key, costs, self.shape, self.elements = sizes
        self.cost = costs[0] if request.return_weights else costs[1]  # the weights in the answer, or not


@dataclass(frozen=True, slots=True)
class _SizePlan:
    """Where a model's Job sizes come from, worked out once per snapshot (LoadedModel.derived)."""

    reads: tuple[tuple[str, int, str], ...]  # (input, position, axis): the request's size of each named axis
    fixed: tuple[str, ...]  # the axes no batch pads (`_fixed_axes`), in the order of `reads`
    others: tuple[str, ...]  # the axes but batch, in that order (Job.shape)
    outputs: tuple[tuple[int, tuple[str, ...], bool], ...]  # an output's fixed sizes' product, its named axes,
    # whether it is the attention weights
    hidden: int  # the numbers a weight is computed from (additive attention's num_hiddens; else 0)

    @staticmethod
    def of(model: LoadedModel) -> _SizePlan:
        plan = model.derived.get("job sizes")
        if plan is None:
            reads = tuple((name, i, axis) for name, named in model.named_input_axes for i, axis in named)
            order = list(dict.fromkeys(axis for _, _, axis in reads))
            fixed = _fixed_axes(model)
            outputs = tuple((math.prod(d for d in spec.shape if d.__class__ is int),
                             tuple(d for d in spec.shape if d.__class__ is str), spec.name == "attention_weights")
                            for spec in model.outputs)
            hidden = int(model.config.hyperparameters.get("num_hiddens", 0)) if model.kind == "additive" else 0
            plan = model.derived["job sizes"] = _SizePlan(reads, tuple(a for a in order if a in fixed),
                                                          tuple(a for a in order if a != "batch"), outputs, hidden)
        return plan


def _sizes(request: Request) -> tuple[dict[str, int], int, int, int, tuple, tuple[int, int], tuple[int, ...], int]:
    """A Job's axes, rows, n_q, n_k, key, what its arrays, run and answer cost in memory with the weights
    in the answer and without (service.core.cost.answer), shape and elements, from its request's shapes."""
    plan = _SizePlan.of(request.model)
    feed = request.feed
    axes = {axis: feed[name].shape[i] for name, i, axis in plan.reads}
    n_q = axes.get("n_q") or axes["n"]
    # The second length of a run's cost: keys, or for the positional encoding its features.
    n_k = axes.get("n_k") or axes.get("d") or n_q
    elements = sum([a.size for a in feed.values()])
    outputs = weights = 0
    for fixed, named, is_weights in plan.outputs:
        size = fixed * math.prod([axes[d] for d in named])
        outputs += size
        if is_weights:
            weights = size
    costs = (answer(elements, outputs, weights, plan.hidden), answer(elements, outputs, weights, plan.hidden, False))
    return (axes, axes["batch"], n_q, n_k, tuple([axes[a] for a in plan.fixed]), costs,
            tuple([axes[a] for a in plan.others]), elements + outputs)


def _heads(model: LoadedModel) -> int:
    return int(model.config.hyperparameters.get("num_heads", 1))


class RunCost:
    """What a session run of one model costs, in seconds: `fixed` + `per_element` * the elements of its
    inputs and outputs (padding included).

    Where it starts: a line through the warm-up's timed runs (LoadedModel.run_times: a small and a larger
    input, the fastest of a few each). Then every run of the batcher refines it, older runs weighing
    `_DECAY` times less a run: while the recent runs' sizes spread enough to tell a slope, the line is
    fitted to them by least squares; else the warm-up's line is scaled by how much slower (or faster) the
    recent runs are than it says (a loaded machine slows both parts alike). Without warm-up runs nothing
    is known until a first run, and no slope (so no padding is worth it) until runs of different sizes."""

    __slots__ = ("fixed", "per_element", "sloped", "_base", "_n", "_x", "_y", "_xx", "_xy", "_ratio")
    _DECAY = 0.98
    _MIN_RUNS = 8.0  # (decayed) runs a fitted slope needs

    def __init__(self, points: list[tuple[int, float]] | tuple = ()):
        self.fixed = math.nan
        self.per_element = 0.0
        self.sloped = False
        self._base: tuple[float, float] | None = None  # the warm-up's line (fixed, per element)
        self._n = self._x = self._y = self._xx = self._xy = self._ratio = 0.0
        if points:
            slope, intercept = _line(points)
            if slope > 0 and intercept >= 0:
                self._base, self.sloped = (intercept, slope), True
            else:
                self._base = (sum(y for _, y in points) / len(points), 0.0)
            self.fixed, self.per_element = self._base

    @classmethod
    def of(cls, fixed: float, per_element: float) -> RunCost:
        """A cost known outright (for tests and benchmarks): it does not follow the runs."""
        cost = cls()
        cost.fixed, cost.per_element, cost.sloped = fixed, per_element, True
        cost._n = math.inf  # observe() leaves it as it is
        return cost

    @property
    def known(self) -> bool:
        return self.fixed == self.fixed  # not NaN

    def predict(self, elements: int) -> float:
        return self.fixed + self.per_element * elements

    def padding_limit(self) -> float:
        """The padded elements a run's fixed cost pays for: a request joins a batch where it adds fewer."""
        if not self.sloped:
            return 0.0
        return self.fixed / self.per_element

    def observe(self, elements: int, seconds: float) -> None:
        if self._n == math.inf:
            return
        if self._base is None:  # the first run of a model not warmed up
            self._base = (seconds, 0.0)
        decay = self._DECAY
        self._n = self._n * decay + 1.0
        self._x = self._x * decay + elements
        self._y = self._y * decay + seconds
        self._xx = self._xx * decay + elements * elements
        self._xy = self._xy * decay + elements * seconds
        fixed, per_element = self._base
        self._ratio = self._ratio * decay + seconds / (fixed + per_element * elements)
        n = self._n
        mean_x, mean_y = self._x / n, self._y / n
        spread = self._xx / n - mean_x * mean_x  # the variance of the sizes
        if n >= self._MIN_RUNS and spread > (0.25 * mean_x) ** 2:  # sizes spread by a quarter of their mean
            slope = (self._xy / n - mean_x * mean_y) / spread
            intercept = mean_y - slope * mean_x
            if slope > 0 and intercept > 0:
                self.fixed, self.per_element, self.sloped = intercept, slope, True
                return
        scale = self._ratio / n
        self.fixed, self.per_element = fixed * scale, per_element * scale


def _line(points: list[tuple[int, float]] | tuple) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points; slope 0 where their x are one."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


def merge(model: LoadedModel, jobs: list[Job], same: bool | None = None) -> dict[str, np.ndarray]:
    """One feed for every job: zero-padded to the largest size of every named axis, stacked along
    batch (see the module's docstring: padded keys are past every job's valid lengths, padded query
    rows repeat their job's last length, dot_product's queries are scaled for a padded d; all sliced off
    the results).
    `same`: whether the jobs have the same shapes, where the caller knows (`_same_shapes`)."""
    if len(jobs) == 1:
        return jobs[0].request.feed
    if _same_shapes(jobs) if same is None else same:
        # Nothing to pad (the usual batch of like requests): stacked in one call an input.
        return {spec.name: np.concatenate([j.request.feed[spec.name] for j in jobs], dtype=jobs[0].request.feed[
            spec.name].dtype) for spec in model.inputs()}
    merged_axes = {name: max(j.axes[name] for j in jobs) for name in jobs[0].axes}
    merged_axes["batch"] = sum(j.rows for j in jobs)
    # dot_product: queries of a shorter d scaled by sqrt(D / d) (1.0: as they are)
    d = merged_axes.get("d") if model.kind == "dot_product" else None
    scales = [1.0 if d is None or j.axes["d"] == d else math.sqrt(d / j.axes["d"]) for j in jobs]
    scaled = d is not None and any(scale != 1.0 for scale in scales)
    feed: dict[str, np.ndarray] = {}
    for spec in model.inputs():
        name = spec.name
        shape = tuple(merged_axes[axis] if axis.__class__ is str else axis for axis in spec.shape)
        merged = np.zeros(shape, dtype=jobs[0].request.feed[name].dtype)
        r = 0
        if name == "queries" and scaled:
            for job, scale in zip(jobs, scales, strict=True):
                part = job.request.feed[name]
                b, n, f = part.shape
                if scale == 1.0:
                    merged[r:r + b, :n, :f] = part
                else:
                    np.multiply(part, np.float32(scale), out=merged[r:r + b, :n, :f])
                r += b
        elif len(shape) == 3:  # the usual case, sliced without building an index (~1 us a job)
            for job in jobs:
                part = job.request.feed[name]
                b, n, f = part.shape
                merged[r:r + b, :n, :f] = part
                r += b
        elif len(shape) == 2:  # valid_lens; a padded query row takes its request's last length
            for job in jobs:
                part = job.request.feed[name]
                b, n = part.shape
                merged[r:r + b, :n] = part
                if n < shape[1]:
                    merged[r:r + b, n:] = part[:, n - 1:]
                r += b
        else:
            for job in jobs:
                part = job.request.feed[name]
                merged[(slice(r, r + part.shape[0]), *(slice(0, n) for n in part.shape[1:]))] = part
                r += part.shape[0]
        feed[name] = merged
    return feed


def _same_shapes(jobs: list[Job]) -> bool:
    """Whether every job has the first's size of every axis but batch."""
    shape = jobs[0].shape
    return all(j.shape == shape for j in jobs)


def _slice(spec_shape: tuple, job: Job, row: int) -> tuple[slice, ...]:
    """A job's part of a merged output: its rows, and its own size of every other named axis."""
    return tuple(slice(row, row + job.rows) if name == "batch" else slice(0, job.axes[name])
                 if name.__class__ is str else slice(None) for name in spec_shape)


def run_batch(model: LoadedModel, jobs: list[Job], metrics: Metrics) -> tuple[list[Any], float]:
    """Merge, run once, slice each job's rows, queries and keys back out, encode each with its
    job's encoder. Returns the bodies and the seconds the session run took."""
    begun = time.perf_counter()
    same = len(jobs) > 1 and _same_shapes(jobs)
    feed = merge(model, jobs, same)
    # The graph without the weights where no job returns them (LoadedModel.run).
    weights = any(job.request.return_weights for job in jobs)
    start = time.perf_counter()
    outputs = model.run(feed, weights)
    seconds = time.perf_counter() - start
    metrics.model(model.name).inference.observe(seconds)
    if len(jobs) == 1:
        job = jobs[0]
        return _ran(model, jobs, [job.encode(model, outputs, job.request.return_weights)], begun, start, seconds)
    results, row = [], 0
    if same:  # each job's part is its rows (a view, contiguous); an output without batch, whole
        by_batch = [(spec.name, spec.shape[0] == "batch") for spec in model.outputs]
        for job in jobs:
            end = row + job.rows
            weights = job.request.return_weights
            mine = {name: outputs[name][row:end] if batched else outputs[name] for name, batched in by_batch
                    if weights or name != "attention_weights"}
            results.append(job.encode(model, mine, weights))
            row = end
        return _ran(model, jobs, results, begun, start, seconds)
    for job in jobs:
        mine = {spec.name: np.ascontiguousarray(outputs[spec.name][_slice(spec.shape, job, row)])
                for spec in model.outputs if job.request.return_weights or spec.name != "attention_weights"}
        results.append(job.encode(model, mine, job.request.return_weights))
        row += job.rows
    return _ran(model, jobs, results, begun, start, seconds)


def _ran(model: LoadedModel, jobs: list[Job], results: list[Any], begun: float, start: float, seconds: float
         ) -> tuple[list[Any], float]:
    """run_batch's return, its stages counted in the model's statistics (service.core.statistics): the
    merge from `begun` to `start`, the run, the slicing and encoding after it."""
    end = time.perf_counter()
    model.statistics.ran(len(jobs), jobs[0].rows if len(jobs) == 1 else sum(j.rows for j in jobs), start - begun,
                         seconds, end - start - seconds, end)
    return results, seconds


def _terms(model: LoadedModel) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]:
    """The elements of a run as sums of products: for each input and output, its fixed sizes' product and
    where its other named axes are in a Job.shape; those with a batch axis (times the rows), and
    those without (the positional encoding's P)."""
    order = {axis: i for i, axis in enumerate(_SizePlan.of(model).others)}  # the axes of a Job.shape
    batched, unbatched = [], []
    for spec in (*model.inputs(), *model.outputs):
        fixed = math.prod(d for d in spec.shape if d.__class__ is int)
        term = (fixed, tuple(order[d] for d in spec.shape if d.__class__ is str and d != "batch"))
        (batched if "batch" in spec.shape else unbatched).append(term)
    return tuple(batched), tuple(unbatched)


def _product_sum(terms: tuple[tuple[int, tuple[int, ...]], ...], shape: tuple[int, ...]) -> int:
    total = 0
    for fixed, where in terms:
        for i in where:
            fixed *= shape[i]
        total += fixed
    return total


class Batcher:
    """The queue of one model and the task that turns it into session runs."""

    def __init__(self, model: LoadedModel, limits: BatchLimits, scheduler: Scheduler):
        self.model = model
        self.limits = limits
        self.scheduler = scheduler
        self.metrics = scheduler.metrics.model(model.name)
        self.heads = _heads(model)
        self.groups: dict[tuple, deque[Job]] = {}
        self._waiter: asyncio.Future | None = None  # the batcher's task, waiting for work
        self._gathering: asyncio.Future | None = None  # a batch waiting for more requests
        self._gather_target = 0
        self._gather_timer: asyncio.TimerHandle | None = None
        self._last_put = 0.0  # when the latest request joined the batch being gathered
        self.size = 0
        self.stepping = False  # a batch is being taken and run (by the batcher's task or by a leader)
        self.running = 0  # batches on inference threads
        # What a run costs: whether a request's padding is worth a batch, and whether a batch runs inline.
        self.run_cost = RunCost(model.run_times)
        self._terms = _terms(model)

    def put(self, job: Job) -> None:
        group = self.groups.get(job.key)
        if group is None:
            group = self.groups[job.key] = deque()
        group.append(job)
        self.size += 1
        if not self.stepping:
            self.wake()
        elif self._gathering is not None and not self._gathering.done():
            if self.size >= self._gather_target:
                self._gathering.set_result(None)  # the batch being gathered is as full as it can get
            else:
                self._last_put = job.enqueued  # still coming: the wait goes on (_gather)

    def wake(self) -> None:
        # A bare future on the cached loop, not asyncio.Event: Event looks the running loop up on
        # every wait, which on Python 3.11 costs a getpid() system call.
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _oldest_group(self) -> deque[Job]:
        return min((g for g in self.groups.values() if g), key=lambda g: g[0].enqueued)

    def _taken(self) -> None:
        """A job left the queue (to run, or answered already)."""
        self.size -= 1
        self.scheduler.queued -= 1


    async def _take(self) -> tuple[list[Job], int]:
        """The next batch, and the elements of its run: the group's oldest job, and those after it
        that fit within the limits and whose padding costs less than their own run would
        (`RunCost`); the others stay queued, in order. Drops jobs whose deadline passed or whose
        client is gone."""
        group = self._oldest_group()
        limits = self.limits
        if limits.enabled and limits.max_wait_s > 0:
            await self._gather(group)
        heads = self.heads
        batched, unbatched = self._terms
        pad_limit = self.run_cost.padding_limit()
        jobs: list[Job] = []
        passed: list[Job] = []  # looked at and left for a later batch
        rows = n_q = n_k = elements = per_row = extra = 0
        shape: tuple[int, ...] = ()
        now = time.monotonic()
        while group:
            job = group.popleft()
            if job.future.done():  # answered already: its deadline passed, or its caller went away
                self._taken()
                continue
            if job.deadline <= now:
                self._taken()
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it waited in the queue"))
                continue
            if job.is_disconnected is not None and now - job.enqueued > _CHECK_CLIENT_AFTER_S \
                    and await job.is_disconnected():
                self._taken()
                job.future.set_exception(ClientGone("the client disconnected"))
                continue
            if not jobs:
                rows, n_q, n_k, shape, elements = job.rows, job.n_q, job.n_k, job.shape, job.elements
                per_row, extra = _product_sum(batched, shape), _product_sum(unbatched, shape)
            elif not limits.enabled:
                passed.append(job)
                break
            else:
                r, q, k = rows + job.rows, max(n_q, job.n_q), max(n_k, job.n_k)
                if job.shape == shape:
                    wider, p, x = shape, per_row, extra
                else:
                    wider = tuple(map(max, shape, job.shape))
                    p, x = (per_row, extra) if wider == shape else (_product_sum(batched, wider),
                                                                    _product_sum(unbatched, wider))
                merged = r * p + x
                if r > limits.max_rows or r * heads * q * k > limits.max_elements \
                        or merged - elements - job.elements > pad_limit:
                    passed.append(job)
                    if rows >= limits.max_rows or len(passed) >= _PASSED:
                        break
                    continue
                rows, n_q, n_k, shape, elements, per_row, extra = r, q, k, wider, merged, p, x
            self._taken()
            jobs.append(job)
        group.extendleft(reversed(passed))
        if not group:
            for key in [k for k, g in self.groups.items() if not g]:
                del self.groups[key]
        return jobs, elements

    async def _gather(self, group: deque[Job]) -> None:
        """Wait for more requests to join while fewer are queued than the server has busy clients
        (service.http.protocol.BusyConnections: the connections that began a request lately, not idle
        ones): they may be about to send. The wait ends `max_wait_s` after the latest request joined
        (requests still coming one after another: W3 at concurrency 16 decodes one every ~0.2 ms,
        and a wait counted from the first gathered ~6 of 16), and at most `_GATHER_CAP` times
        `max_wait_s` after the oldest came. A server that says it has no other busy client is not
        waited for; one that does not say (a test client) is waited for until requests stop coming."""
        busy = self.scheduler.busy_clients
        target = len(busy) if busy is not None else 1 << 30
        max_wait = self.limits.max_wait_s
        now = time.monotonic()
        rows = sum(j.rows for j in group)
        head = group[0]
        # A batch that could not take another request like its first does not wait for one (W2, 131K
        # weight elements a request against a limit of 128K, would only lose the wait).
        full = 2 * rows * self.heads * head.n_q * head.n_k > self.limits.max_elements
        cap = head.enqueued + _GATHER_CAP * max_wait
        if min(group[-1].enqueued + max_wait, cap) <= now or self.size >= target or rows >= self.limits.max_rows \
                or full:
            return
        loop = self.scheduler.loop
        gathering = self._gathering = loop.create_future()
        self._gather_target, self._last_put = target, group[-1].enqueued
        # A method and its arguments, not a closure: a closure that re-arms its own timer refers to
        # itself, a reference cycle a batch, left to the garbage collector.
        self._gather_timer = loop.call_later(max(self._last_put + max_wait - now, 0), self._expire, gathering,
                                             max_wait, cap)
        try:
            await gathering
        finally:
            self._gather_timer.cancel()
            self._gather_timer = None
            self._gathering = None

    def _expire(self, gathering: asyncio.Future, max_wait: float, cap: float) -> None:
        """The gathering's timer: the wait ends `max_wait` after the latest request joined, at `cap` at most."""
        if gathering.done():
            return
        now = time.monotonic()
        end = min(self._last_put + max_wait, cap)
        if now >= end:
            gathering.set_result(None)
        else:  # uvloop counts whole milliseconds: at least one, not a spin through the loop
            self._gather_timer = self.scheduler.loop.call_later(max(end - now, 1e-3), self._expire, gathering,
                                                                max_wait, cap)

    def _inline(self, elements: int, limit: float) -> bool:
        """Whether a run of this many elements is predicted to take less than `limit` seconds."""
        cost = self.run_cost
        return cost.known and cost.predict(elements) < limit

    def _observe(self, jobs: list[Job]) -> None:
        metrics = self.metrics
        start = time.monotonic()
        waited = 0.0
        for job in jobs:
            metrics.queue_time.observe(start - job.enqueued)
            waited += start - job.enqueued
        self.model.statistics.queued(len(jobs), waited)
        metrics.batch_requests.observe(len(jobs))
        metrics.batch_rows.observe(sum(j.rows for j in jobs))

    @staticmethod
    def _deliver(jobs: list[Job], results: list[Any] | None, error: BaseException | None) -> None:
        for i, job in enumerate(jobs):
            if not job.future.done():
                if error is None:
                    job.future.set_result(results[i])  # type: ignore[index]
                else:
                    job.future.set_exception(error)

    async def step(self) -> None:
        """Take the next batch and run it: on the loop when it is short, else on an inference
        thread (this returns once the thread has it)."""
        scheduler = self.scheduler
        jobs, elements = await self._take()
        if scheduler.depth_gauge is not None:
            scheduler.depth_gauge.set(scheduler.queued)
        if not jobs:
            return
        self._observe(jobs)
        if self._inline(elements, self.limits.inline_run_s):
            try:
                results, seconds = run_batch(self.model, jobs, scheduler.metrics)
            except Exception as e:
                self._deliver(jobs, None, e)
            else:
                self.run_cost.observe(elements, seconds)
                self._deliver(jobs, results, None)
        else:
            await scheduler.threads.acquire()
            self.running += 1
            scheduler.spawn(self._in_thread(jobs, elements))

    def run_alone(self, job: Job) -> Any:
        """`job` at once, in the caller's task, with no queue: for a request the server says is the
        only one in progress (nothing could join its batch) and whose run is short."""
        if job.deadline <= time.monotonic():
            raise DeadlineExceeded("the request's deadline passed before it could run")
        self._observe([job])
        results, seconds = run_batch(self.model, [job], self.scheduler.metrics)
        self.run_cost.observe(job.elements, seconds)
        return results[0]

    async def lead(self, job: Job) -> None:
        """Run `job`'s batch in the caller's task, when the batcher is idle: one pass of the event
        loop first, so that the requests already read from the sockets join it. No hand-off to the
        batcher's task, which costs several passes of the loop."""
        self.stepping = True
        try:
            await asyncio.sleep(0)
            await self.step()
        finally:
            self.stepping = False
            if self.size:
                self.wake()  # what arrived meanwhile: the batcher's task takes it

    async def loop(self) -> None:
        scheduler = self.scheduler
        while True:
            while not self.size or self.stepping:
                self._waiter = scheduler.loop.create_future()
                await self._waiter
            self.stepping = True
            try:
                await self.step()
            finally:
                self.stepping = False
            await asyncio.sleep(0)  # the callers of this batch answer; new requests join the next one

    async def _in_thread(self, jobs: list[Job], elements: int) -> None:
        scheduler = self.scheduler
        try:
            results, seconds = await scheduler.loop.run_in_executor(
                scheduler.executor, run_batch, self.model, jobs, scheduler.metrics)
        except Exception as e:
            self._deliver(jobs, None, e)
        else:
            self.run_cost.observe(elements, seconds)
            self._deliver(jobs, results, None)
        finally:
            self.running -= 1
            scheduler.threads.release()


class Scheduler:
    """Every model's batcher, the shared bound on queued requests, and the inference threads."""

    def __init__(self, models: list[LoadedModel], limits: BatchLimits, threads: int, metrics: Metrics):
        self.limits = limits
        self.metrics = metrics
        self.threads = asyncio.Semaphore(threads)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="inference")
        self.queued = 0
        # The queue-depth gauge: read at scrape time from `queued`; with workers, set as it changes.
        self.depth_gauge = metrics.track_queue_depth(lambda: self.queued)
        # The HTTP server's busy clients, where it tells (python -m service: a BusyConnections):
        # how many requests a batch can expect at most.
        self.busy_clients: Sized | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        # One batcher (a queue and its task) per snapshot being served: a new version gets its own,
        # and a retired one drains what it holds, then goes.
        self.batchers: dict[tuple[str, int], Batcher] = {}
        self._loops: dict[tuple[str, int], asyncio.Task] = {}
        self._models = list(models)
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        """In the event loop that will serve: it is looked up once, here (on Python 3.11 every
        asyncio.get_running_loop() costs a getpid() system call)."""
        self.loop = asyncio.get_running_loop()
        for model in self._models:
            self.batcher_for(model)

    def batcher_for(self, model: LoadedModel) -> Batcher:
        """The batcher of this snapshot, made (with its task) the first time it is asked for."""
        key = (model.name, model.config.version)
        batcher = self.batchers.get(key)
        if batcher is None or batcher.model is not model:
            batcher = self.batchers[key] = Batcher(model, self.limits, self)
            task = self._loops[key] = self.loop.create_task(batcher.loop())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return batcher

    async def retire(self, model: LoadedModel, timeout: float) -> bool:
        """Let the snapshot's batcher finish what it holds (queued, and running on a thread), then
        stop it. False when that took longer than `timeout` (it is stopped anyway)."""
        key = (model.name, model.config.version)
        batcher = self.batchers.get(key)
        if batcher is None or batcher.model is not model:
            return True
        end = self.loop.time() + timeout
        while (batcher.size or batcher.stepping or batcher.running) and self.loop.time() < end:
            await asyncio.sleep(0.005)
        drained = not (batcher.size or batcher.stepping or batcher.running)
        if self.batchers.get(key) is batcher:
            del self.batchers[key]
            self._loops.pop(key).cancel()
        return drained

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=False)

    async def submit(self, job: Job, alone: bool = False) -> Any:
        """Queue `job` and wait for its response body; 503 at once when the queue is full, 504
        when the deadline passes first. `alone`: no other request is in progress in the server."""
        if self.queued >= self.limits.max_queue:
            self.metrics.rejected.labels(job.request.model.name).inc()
            raise Overloaded(f"the queue is full ({self.limits.max_queue} requests waiting); retry shortly",
                             headers={"Retry-After": "1"})
        batcher = self.batcher_for(job.request.model)
        idle = not batcher.stepping and not batcher.size
        if idle and alone and batcher._inline(job.elements, self.limits.alone_inline_run_s):
            return batcher.run_alone(job)
        loop = self.loop
        job.future = future = loop.create_future()
        self.queued += 1
        if self.depth_gauge is not None:
            self.depth_gauge.set(self.queued)
        batcher.put(job)
        # A timer, not wait_for (a task per call): at the deadline the caller gets its 504 even if a
        # long run holds the batch; the batcher drops the job if it has not run yet.
        timer = loop.call_later(max(job.deadline - time.monotonic(), 0), _expire, future)
        try:
            if idle:
                await batcher.lead(job)
            return await future
        finally:
            timer.cancel()
            if not future.done():
                future.cancel()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("the request's deadline passed before its batch ran"))
