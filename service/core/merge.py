"""A batch's one session run: its jobs' inputs merged (zero-padded, stacked) into one feed, run, and each
job's own rows, queries, keys and features sliced back out and encoded."""

from __future__ import annotations

import math
import re
import time
import warnings
from typing import Any

import numpy as np

from service.core import tracing
from service.core.errors import NotFinite, OutOfDeviceMemory
from service.core.jobs import Job, SizePlan
from service.core.metrics import Metrics
from service.core.request import finite
from service.core.runtime import LoadedModel

# Queries scaled past float32 for a padded d become inf; their jobs run again alone (`_alone`), and NumPy's
# warning would only say so.
warnings.filterwarnings("ignore", message="overflow encountered in multiply", category=RuntimeWarning,
                        module=r"service\.core\.merge")
# What ONNX Runtime says where an allocation failed: its arena's (CPU or CUDA), or CUDA's own.
_OUT_OF_MEMORY = re.compile(r"Failed to allocate memory|out of memory|cudaErrorMemoryAllocation|bad_alloc")


def merge(model: LoadedModel, jobs: list[Job], same: bool | None = None) -> dict[str, np.ndarray]:
    """One feed for every job: zero-padded to the largest size of every named axis, stacked along
    batch (see the module's docstring: padded keys are past every job's valid lengths, padded query
    rows repeat their job's last length, dot_product's queries are scaled for a padded d; all sliced off
    the results).
    `same`: whether the jobs have the same shapes, where the caller knows (`same_shapes`)."""
    if len(jobs) == 1:
        return jobs[0].request.feed
    if same_shapes(jobs) if same is None else same:
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
        elif len(shape) == 3:  # the usual case, sliced without building an index (paid once a job)
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


def same_shapes(jobs: list[Job]) -> bool:
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
    same = len(jobs) > 1 and same_shapes(jobs)
    feed = merge(model, jobs, same)
    # The graph for a batch of its size that returns the weights, or none where no job returns them
    # (service.core.choice); its elements are its jobs' where nothing is padded.
    weights = any(job.request.return_weights for job in jobs)
    graph = model.graph_for(weights, jobs[0].elements if len(jobs) == 1 else sum(j.elements for j in jobs)
                            if same else model.elements_of(feed))
    start = time.perf_counter()
    try:
        outputs = graph.run(feed, weights)
    except Exception as e:
        if _OUT_OF_MEMORY.search(str(e)):  # the session and the process live on: only this batch failed
            raise OutOfDeviceMemory(f"the run of {len(jobs)} request(s) did not fit in the memory of "
                                    f"{graph.provider}", headers={"Retry-After": "1"}) from None
        raise
    seconds = time.perf_counter() - start
    metrics.model(model.name).inference.observe(seconds)
    # A NaN or an infinity anywhere in a job's answer shows in its outputs (the weights are a softmax, and the
    # outputs their products): one look at the batch's, and at each job's only where that finds one.
    overflowed = not finite(outputs["outputs"])
    if len(jobs) == 1:
        job = jobs[0]
        if overflowed:
            raise _not_finite(model)
        return ran(model, jobs, [job.encode(model, outputs, job.request.return_weights)], begun, start, seconds)
    results, row = [], 0
    if same:  # each job's part is its rows (a view, contiguous); an output without batch, whole
        by_batch = [(spec.name, spec.shape[0] == "batch") for spec in model.outputs]
        for job in jobs:
            end = row + job.rows
            weights = job.request.return_weights
            mine = {name: outputs[name][row:end] if batched else outputs[name] for name, batched in by_batch
                    if weights or name != "attention_weights"}
            results.append(_alone(model, job, metrics) if overflowed and not finite(mine["outputs"])
                           else job.encode(model, mine, weights))
            row = end
        return ran(model, jobs, results, begun, start, seconds)
    for job in jobs:
        mine = {spec.name: np.ascontiguousarray(outputs[spec.name][_slice(spec.shape, job, row)])
                for spec in model.outputs if job.request.return_weights or spec.name != "attention_weights"}
        results.append(_alone(model, job, metrics) if overflowed and not finite(mine["outputs"])
                       else job.encode(model, mine, job.request.return_weights))
        row += job.rows
    return ran(model, jobs, results, begun, start, seconds)


def _not_finite(model: LoadedModel) -> NotFinite:
    return NotFinite(f"the outputs of {model.name} for these inputs are not finite: they are within float32's "
                     "range (|x| <= 3.4e38), but a score or a projection of them is not; send smaller numbers")


def _alone(model: LoadedModel, job: Job, metrics: Metrics) -> Any:
    """The answer of a job whose part of a batch's outputs is not finite, run again by itself (the batch's
    padding may have scaled its queries past float32: `merge`), or its NotFinite."""
    try:
        return run_batch(model, [job], metrics)[0][0]
    except NotFinite as e:
        return e


def ran(model: LoadedModel, jobs: list[Job], results: list[Any], begun: float, start: float, seconds: float
         ) -> tuple[list[Any], float]:
    """run_batch's return, its stages counted in the model's statistics (service.core.statistics): the
    merge from `begun` to `start`, the run, the slicing and encoding after it."""
    end = time.perf_counter()
    model.statistics.ran(len(jobs), jobs[0].rows if len(jobs) == 1 else sum(j.rows for j in jobs), start - begun,
                         seconds, end - start - seconds, end)
    if tracing.on:  # the run as one span, linked to its traced requests
        tracing.ran(model, jobs, begun, start, seconds, end)
    return results, seconds


def run_terms(model: LoadedModel) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]:
    """The elements of a run as sums of products: for each input and output, its fixed sizes' product and
    where its other named axes are in a Job.shape; those with a batch axis (times the rows), and
    those without (the positional encoding's P)."""
    order = {axis: i for i, axis in enumerate(SizePlan.of(model).others)}  # the axes of a Job.shape
    batched, unbatched = [], []
    for spec in (*model.inputs(), *model.outputs):
        fixed = math.prod(d for d in spec.shape if d.__class__ is int)
        term = (fixed, tuple(order[d] for d in spec.shape if d.__class__ is str and d != "batch"))
        (batched if "batch" in spec.shape else unbatched).append(term)
    return tuple(batched), tuple(unbatched)


def product_sum(terms: tuple[tuple[int, tuple[int, ...]], ...], shape: tuple[int, ...]) -> int:
    total = 0
    for fixed, where in terms:
        for i in where:
            fixed *= shape[i]
        total += fixed
    return total
