"""What a request costs in memory, known (or bounded from above) before anything is materialized, and
the budget of what the requests in flight may cost together (ATTEND_MAX_INFLIGHT_BYTES).

One place computes it, for every form a body can take; a transport and a codec only say which form
theirs is. A request's reservation grows and shrinks with it (`Cost.hold`), stage by stage:

    the body as it arrives      its bytes (twice, where the server hands it over in pieces to be joined),
                                and what its decode will hold at least (the codec says, from the headers):
                                a request is let in only where most of what it will cost fits
    inflated (gzip, deflate)    the compressed bytes, and twice the inflated ones while they are joined
    decoded: JSON               the body, what parsing holds (simdjson's tape and indexes, the doubles, the
                                float32 arrays, a proxy a JSON array), bounded from the body's count of
                                ',' and '[': every number is followed by a ',' or closes an array
    decoded: binary tensors     the body (read in place), and an aligned copy or a float32 cast of each
                                tensor where it needs one
    run and answered            the inputs, the outputs, ONNX Runtime's intermediates of the attention
                                weights (additive attention's of each hidden unit), and the encoded
                                answer (the weights' JSON only where they are asked for)

The constants are measured (peak resident memory of a decode or a run, over a sweep of sizes and forms:
`python tests/load/membound.py`, docs/reliability.md), with room above each.
"""

from __future__ import annotations

import threading

import numpy as np

from service.core.errors import Overloaded, PayloadTooLarge

# Bodies up to this size may be read the slow and precise ways (Python objects: the error of a client
# named element by element, integers beyond 64 bits); larger ones never are (service.protocols.attend).
PRECISE_BODY_BYTES = 1 << 20
# Bytes a number of a JSON body costs while it is decoded: simdjson's tape (16) and structural indexes
# (~8), its double (8), its float32 (4), their joins (8); measured 34-38 (docs/reliability.md).
_PER_NUMBER = 44
# ... where the precise way may hold it as Python objects (a float, a list slot, twice: orjson's and the
# standard library's duplicate-key check).
_PER_NUMBER_PRECISE = 100
# ... a JSON array: a simdjson proxy a row while the rows' lengths are checked (measured 45-48).
_PER_ARRAY = 56
# The body's own bytes again while simdjson parses it: its padded copy (1), and where strings are, the
# buffer it writes them into (5/3 a byte of the body) and the Python strings made of them.
_PER_BODY_BYTE = 4
# An output number: float32 (4) and its JSON (up to ~16: -1.2345678e-05,); the attention weights also ONNX
# Runtime's intermediates (the scores and their masked copies; the largest weights the limits allow
# measured ~31 bytes a weight in all). Weights not asked for are not encoded: their float32 (where the
# graph that runs makes them) and the intermediates.
_PER_OUTPUT = 20
_PER_WEIGHT = 20
_PER_UNSENT_WEIGHT = 4 + _PER_WEIGHT
# Additive attention's scoring holds num_hiddens numbers a weight: the broadcast sum of the projected
# queries and keys, and its tanh (two float32 buffers; the largest weights measured ~6 bytes a hidden unit
# a weight, returned or not: `python tests/load/membound.py`).
_PER_HIDDEN = 8
# A weight of a decomposed graph on the GPU: the scores, scaled, masked and their softmax, as ONNX Runtime's
# memory plan keeps them (bench/compute.py --device cuda measures the peak: docs/performance).
_DEVICE_PER_WEIGHT = 16
_SCAN_CHUNK = 1 << 20


# Bodies up to this size are counted by bytes.count (two C loops, no call into NumPy); larger ones by
# NumPy's vector loops, whose fixed cost a call pays off past a few KiB.
_COUNT_IN_BYTES = 4096


def json_counts(body: bytes | memoryview) -> tuple[int, int]:
    """(commas, opening brackets) of a JSON body, counted in NumPy's vector loops a megabyte at a time
    (so each comparison's temporary array stays small): together they bound its numbers and arrays."""
    if len(body) <= _COUNT_IN_BYTES:
        small = body if body.__class__ is bytes else bytes(body)
        return small.count(b","), small.count(b"[")
    view = np.frombuffer(body, dtype=np.uint8)
    commas = brackets = 0
    for start in range(0, view.size, _SCAN_CHUNK):
        chunk = view[start:start + _SCAN_CHUNK]
        commas += int(np.count_nonzero(chunk == 44))  # ,
        brackets += int(np.count_nonzero(chunk == 91))  # [
    return commas, brackets


def json_decode(size: int, commas: int, brackets: int) -> int:
    """What decoding a JSON body of `size` bytes holds at most, the body itself not counted."""
    numbers = commas + brackets
    per_number = _PER_NUMBER_PRECISE if size <= PRECISE_BODY_BYTES else _PER_NUMBER
    return _PER_BODY_BYTE * size + per_number * numbers + _PER_ARRAY * brackets


# JSON bodies up to this size are not counted: what their decode holds is bounded from their size alone
# (every byte a '[': 160 bytes a byte, 320 KiB at most), which costs less than counting (a few us of
# the smallest requests' ~50) and is nothing beside the budget.
SMALL_JSON_BYTES = 2048
# ... and bodies up to this size neither, while the budget has room for that bound (10 MiB at most) and
# half the budget besides; past it, counted.
ROUGH_JSON_BYTES = 64 * 1024


def json_bound(size: int) -> int:
    """What decoding any JSON body of `size` bytes could hold: as if every byte were a '['."""
    return json_decode(size, 0, size)


def json_expected(size: int) -> int:
    """What decoding a JSON body of `size` bytes will hold, known from its size: at least (the body not yet
    counted), or for a small body (SMALL_JSON_BYTES) at most."""
    if size <= SMALL_JSON_BYTES:
        return json_bound(size)
    return json_decode(size, 0, 0)


def binary_decode(count: int, itemsize: int, floating: bool, misaligned: bool) -> int:
    """What a binary tensor of `count` numbers read in place holds besides the body: an aligned copy where
    it is not, a float32 cast of another float type (FP16 doubles), the finiteness check's mask."""
    size = count * itemsize if misaligned else 0
    if floating:
        size += count * (4 if itemsize != 4 else 0) + count
    return size


def answer(inputs: int, outputs: int, weights: int, hidden: int = 0, sent: bool = True) -> int:
    """A decoded request's arrays (`inputs` float32 numbers) and its run and answer: `outputs` numbers
    out, `weights` of them the attention weights, each computed from `hidden` numbers (additive
    attention's num_hiddens; 0 where the scores are dot products), and `sent` in the answer or not."""
    per_weight = (_PER_OUTPUT + _PER_WEIGHT if sent else _PER_UNSENT_WEIGHT) + _PER_HIDDEN * hidden
    return 4 * inputs + _PER_OUTPUT * (outputs - weights) + per_weight * weights


def device_run(inputs: int, outputs: int, weights: int, hidden: int = 0, scores: bool = True) -> int:
    """What a run holds in the execution provider's memory: its inputs and outputs (`outputs` numbers, `weights`
    of them the attention weights), and, where the graph keeps a score matrix (`scores`), its copies of it
    (additive attention's also `hidden` numbers a weight); a fused kernel without the weights, given the key
    lengths of each example, keeps none."""
    if not scores:
        return 4 * (inputs + outputs - weights)
    return 4 * (inputs + outputs) + (_DEVICE_PER_WEIGHT + 8 * hidden) * weights


class Budget:
    """The bytes that the requests in flight may cost together, per process: of host memory
    (ATTEND_MAX_INFLIGHT_BYTES), or of the GPU's (ATTEND_MAX_DEVICE_BYTES). Taken and given from the event
    loop and from decode threads."""

    def __init__(self, limit: int, setting: str = "ATTEND_MAX_INFLIGHT_BYTES", of: str = "memory"):
        self.limit = limit
        self.used = 0
        self.lock = threading.Lock()
        self.setting = setting  # what the messages name
        self.of = of

    def give(self, size: int) -> None:
        with self.lock:
            self.used -= size


class Cost:
    """One request's share of the budget, as it grows and shrinks stage by stage."""

    __slots__ = ("budget", "held", "peak", "base")

    def __init__(self, budget: Budget):
        self.budget = budget
        self.held = 0
        self.peak = 0  # the most it held
        self.base = 0  # the body's bytes, once it is in (what a decode's cost comes on top of)

    def hold(self, total: int, what: str = "this request") -> None:
        """The request costs `total` bytes from now on. More than the whole budget: 413; more than what
        is left of it: 503 + Retry-After (the others finish first). Nothing is held then."""
        extra = total - self.held
        budget = self.budget
        if extra > 0:
            if total > budget.limit:
                raise PayloadTooLarge(f"{what} would take {total} bytes of {budget.of} to serve, over this service's "
                                      f"limit of {budget.limit} ({budget.setting})",
                                      expected=f"<= {budget.limit}", received=total)
            with budget.lock:  # (Budget.take, inline: this is on every request's path, several times)
                taken = budget.used + extra <= budget.limit
                if taken:
                    budget.used += extra
            if not taken:
                raise Overloaded(f"requests in flight hold {budget.used} of {budget.limit} bytes of {budget.of} "
                                 f"({budget.setting}); {what} needs {extra} more; retry shortly",
                                 headers={"Retry-After": "1"})
            if total > self.peak:
                self.peak = total
        elif extra < 0:
            with budget.lock:
                budget.used += extra
        self.held = total

    def roughly(self, total: int) -> bool:
        """Hold `total` bytes (a bound from above, cheaper to know than the count) where the budget
        has room for it and half of itself besides; False, holding nothing more, where it has not."""
        if total <= self.held:
            return True
        budget = self.budget
        extra = total - self.held
        with budget.lock:
            if budget.used + extra > budget.limit // 2:
                return False
            budget.used += extra
        self.held = total
        if total > self.peak:
            self.peak = total
        return True

    def at_least(self, total: int, what: str = "this request") -> None:
        """Hold `total` bytes, unless more is held already (then nothing is given back)."""
        if total > self.held:
            self.hold(total, what)

    def add(self, extra: int, what: str = "this request") -> None:
        self.hold(self.held + extra, what)

    def decoding(self, size: int, what: str = "decoding this body") -> None:
        """The body and what its decode holds (`size`), in place of what was expected of it."""
        self.hold(self.base + size, what)

    def release(self) -> None:
        if self.held:
            self.budget.give(self.held)
            self.held = 0
