"""A request in the batching queue (`Job`): its sizes along each axis of its model's signature, which of
them a batch may pad, and what its arrays, run and answer cost in memory."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.choice import device_steps, step
from service.core.cost import answer, device_run
from service.core.request import Request
from service.core.runtime import CUDA, LoadedModel

# (model, one request's outputs by name, whether it asked for the attention weights) -> its response body
Encoder = Callable[[LoadedModel, dict[str, np.ndarray], bool], Any]


_SEQUENCE = ("n_q", "n_k", "n")
_CUDA_INDEX = 1 << 31  # elements of a tensor that ONNX Runtime's CUDA kernels (Softmax, Where) can index


# The feature sizes that a kind's graph leaves free and a batch may pad (see the module's docstring).
_PADDED_FEATURES = {"dot_product": ("d", "value_size"), "additive": ("value_size",)}


def fixed_axes(model: LoadedModel) -> frozenset[str]:
    """The named axes a batch cannot pad: its requests have the same size of each."""
    padded = {"batch", *_SEQUENCE, *_PADDED_FEATURES.get(model.kind, ())}
    return frozenset(axis for _, named in model.named_input_axes for _, axis in named if axis not in padded)


class Job:
    """One request in the queue: its future gets the encoded response, or the error.

    `axes` holds the request's size of every named axis of its model's signature (batch, n_q, n_k
    or n, and the free feature sizes); `shape` the same but batch, in the signature's order; `key`
    the sizes no batch pads (requests of one key may merge); `elements` those of its run's inputs
    and outputs (`RunCost`); `cost` and `device` what it holds in host memory and in the execution
    provider's (service.core.cost), the latter by the graphs its batch may run (service.core.choice)."""

    __slots__ = ("request", "deadline", "encode", "is_disconnected", "enqueued", "future", "axes", "rows", "n_q",
                 "n_k", "key", "cost", "device", "unindexable", "shape", "elements", "text", "trace")

    def __init__(self, request: Request, deadline: float, encode: Encoder | None = None,
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None, future: asyncio.Future | None = None):
        self.request = request
        self.deadline = deadline  # time.monotonic()
        self.encode = encode
        self.is_disconnected = is_disconnected
        self.enqueued = time.monotonic()
        self.future = future
        self.trace: Any = None  # its request's sampled trace (service.core.tracing.RequestTrace), while tracing is on
        memo = request.memo  # requests of one layout (service.protocols.attend's plans) share their sizes
        sizes = None if memo is None else memo.get("job sizes")
        if sizes is None:
            sizes = job_sizes(request)
            if memo is not None:
                memo["job sizes"] = sizes
        self.axes, self.rows, self.n_q, self.n_k, self.key, costs, self.shape, self.elements, answers = sizes
        weights = request.return_weights
        # The numbers its answer writes as text (JSON): their encode, not the run, is most of a large answer's cost.
        self.text = (answers[0] if weights else answers[1]) if request.text_answer else 0
        self.cost = costs[0] if weights else costs[1]  # the weights in the answer, or not
        self.device = costs[2]
        self.unindexable = costs[4]  # its scores would pass the GPU kernels' 32-bit indexes
        if costs[3] is not None:  # a graph without the weights that keeps no scores may run where no job wants them...
            lens = request.feed["valid_lens"]
            # ... and the lengths are one an example (the fused kernel's key lengths; a mask per query is
            # a bias as large as the scores): so jobs merge only with their like.
            linear = not weights and (lens.shape[1] <= 1 or bool((lens == lens[:, :1]).all()))
            self.key = (*self.key, linear)
            if linear:
                self.device, self.unindexable = costs[3], costs[5]


@dataclass(frozen=True, slots=True)
class SizePlan:
    """Where a model's Job sizes come from, worked out once per snapshot (LoadedModel.derived)."""

    reads: tuple[tuple[str, int, str], ...]  # (input, position, axis): the request's size of each named axis
    fixed: tuple[str, ...]  # the axes no batch pads (`fixed_axes`), in the order of `reads`
    others: tuple[str, ...]  # the axes but batch, in that order (Job.shape)
    outputs: tuple[tuple[int, tuple[str, ...], bool], ...]  # an output's fixed sizes' product, its named axes,
    # whether it is the attention weights
    hidden: int  # the numbers a weight is computed from (additive attention's num_hiddens; else 0)
    linear: bool  # a graph that may run a batch without the weights keeps no score matrix (a fused kernel on CUDA)
    # What a batch holds in the execution provider's memory, by a job's elements (service.core.choice.device_steps):
    # of a job that returns no weights and whose lengths are one an example, and of any other.
    device_linear: tuple[tuple[int, int], ...]
    device_other: tuple[tuple[int, int], ...]

    @staticmethod
    def of(model: LoadedModel) -> SizePlan:
        plan = model.derived.get("job sizes")
        if plan is None:
            reads = tuple((name, i, axis) for name, named in model.named_input_axes for i, axis in named)
            order = list(dict.fromkeys(axis for _, _, axis in reads))
            fixed = fixed_axes(model)
            outputs = tuple((math.prod(d for d in spec.shape if d.__class__ is int),
                             tuple(d for d in spec.shape if d.__class__ is str), spec.name == "attention_weights")
                            for spec in model.outputs)
            hidden = int(model.config.hyperparameters.get("num_hiddens", 0)) if model.kind == "additive" else 0
            linear = any(g.linear for _, g in model.choice[False])
            plan = model.derived["job sizes"] = SizePlan(reads, tuple(a for a in order if a in fixed),
                                                         tuple(a for a in order if a != "batch"), outputs, hidden,
                                                         linear, *device_steps(model))
        return plan


def job_sizes(request: Request) -> tuple[dict[str, int], int, int, int, tuple, tuple[Any, ...], tuple[int, ...], int,
                                         tuple[int, int]]:
    """A Job's axes, rows, n_q, n_k, key, costs, shape, elements and answers (the numbers of its answer with
    the weights and without), from its request's shapes. Its costs:
    in host memory with the weights in the answer and without (service.core.cost.answer); in the execution
    provider's, of the graphs its batch may run at its size or larger (service.core.choice.device_steps): as
    any job, and as one that returns no weights with lengths one an example, where a graph without the
    weights that keeps no scores may run (None: none may); and for each, whether its scores would pass CUDA's
    32-bit indexes."""
    plan = SizePlan.of(request.model)
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
    full = device_run(elements, outputs, weights, plan.hidden)
    linear = device_run(elements, outputs, weights, 0, False) if plan.linear else 0
    total = elements + outputs
    other_kind = step(plan.device_other, total)
    linear_kind = step(plan.device_linear, total) if plan.linear else 0
    # A score matrix of 2^31 elements or more on CUDA: past the 32-bit indexes of ONNX Runtime's CUDA kernels
    # (an illegal memory access that leaves the process's CUDA context unusable), so it never runs.
    past = weights >= _CUDA_INDEX and request.model.provider == CUDA
    costs = (answer(elements, outputs, weights, plan.hidden), answer(elements, outputs, weights, plan.hidden, False),
             (0, full, full)[other_kind], (0, linear, full)[linear_kind] if plan.linear else None,
             past and other_kind == 2, past and linear_kind == 2)
    return (axes, axes["batch"], n_q, n_k, tuple([axes[a] for a in plan.fixed]), costs,
            tuple([axes[a] for a in plan.others]), elements + outputs, (outputs, outputs - weights))


def heads_of(model: LoadedModel) -> int:
    return int(model.config.hyperparameters.get("num_heads", 1))
