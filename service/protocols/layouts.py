"""Plans of body layouts: a small /attend body whose layout passed every check once is, the next time, only
parsed, cast and checked for what its numbers can get wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import simdjson

from service.core.errors import ServiceError
from service.core.request import Request, RequestLimits, check_valid_lens, finite
from service.core.runtime import LoadedModel

# Clients send the same layout again and again: the same keys, model and shapes, other numbers.
# Every check of a small body but those of its numbers depends only on its keys and its `skeleton`
# (the body without numbers and blanks, which fixes every array's shape and that it holds only
# numbers, and the type of every other value), so a layout that passed them once leaves a plan on
# the model's snapshot, and the next body of that layout is only parsed, cast and checked for what
# its numbers can get wrong: finite float32, and whole valid lengths within n_k. (The model and
# version are resolved from each body, and a body whose numbers fail is decoded the long way,
# which names the field.) On the book's multi-head example the plan saves much of the decode.

_PLANS_PER_MODEL = 64  # layouts kept a snapshot (at most a small body's size each); then it starts over


# Making a plan costs its body time, which only later bodies of its layout win back. So a layout gets one
# when it comes a second time among the last
# _LAYOUTS_SEEN layouts (their hashes: ints, ~60 bytes each): varied bodies, which rarely come twice, are
# spared making plans they would never use.
_LAYOUTS_SEEN = 4 * _PLANS_PER_MODEL


@dataclass(frozen=True, slots=True)
class Plan:
    keys: tuple[str, ...]  # the body's keys, in order (the skeleton strips digits and 'e' from strings)
    limits: RequestLimits  # what the shapes were checked against
    arrays: tuple[tuple[str, tuple[int, ...], int, int], ...]  # input, shape, its start and end in the numbers
    lens_shape: tuple[int, ...] | None  # the valid lengths' shape, where the body has them
    takes_lens: bool  # the model has a valid_lens input (absent or null: every key valid)
    lengths: tuple[int, int, int]  # batch, n_q, n_k
    memo: dict[str, Any]  # Request.memo of this layout's requests

    def request(self, model: LoadedModel, data: dict[str, Any]) -> Request | None:
        """The request from a body of this layout; None where its numbers fail a check."""
        if data[self.arrays[0][0]].__class__ is not simdjson.Array:
            return None  # parsed the slow way (integers beyond 64 bits): Python lists
        try:
            buffers = [data[name].as_buffer(of_type="d") for name, _, _, _ in self.arrays]
        except (TypeError, ValueError, RuntimeError):
            return None
        flat = np.frombuffer(b"".join(buffers), dtype=np.float64).astype(np.float32)
        if not finite(flat):
            return None
        feed = {name: flat[start:end].reshape(shape) for name, shape, start, end in self.arrays}
        if self.takes_lens:
            lens = self._valid_lens(data)
            if lens is None:
                return None
            feed["valid_lens"] = lens
        return Request(model, feed, data.get("return_weights", True), self.memo)

    def _valid_lens(self, data: dict[str, Any]) -> np.ndarray | None:
        """(batch, n_q) int64, or None where the body's lengths are not whole numbers within n_k."""
        try:
            lens = None
            if self.lens_shape is not None:  # else absent or null: every key
                lens = np.frombuffer(data["valid_lens"].as_buffer(of_type="d"), dtype=np.float64)
                lens = lens.reshape(self.lens_shape)
            return check_valid_lens(lens, *self.lengths)
        except (TypeError, ValueError, RuntimeError, ServiceError):
            return None


def remember(model: LoadedModel, layout: bytes, data: dict[str, Any], limits: RequestLimits,
              tensors: dict[str, np.ndarray], lens: np.ndarray | None, lengths: tuple[int, int, int]
              ) -> dict[str, Any] | None:
    """Leave the plan of a small body that passed every check on its model's snapshot, where its layout
    was seen before; its memo (None for a layout seen the first time)."""
    seen = model.body_layouts_seen
    key = hash(layout)
    if key not in seen:
        if len(seen) >= _LAYOUTS_SEEN:
            seen.clear()
        seen.add(key)
        return None
    arrays, start = [], 0
    for name, array in tensors.items():  # in the order of the body's numbers (small_body_arrays')
        arrays.append((name, array.shape, start, start + array.size))
        start += array.size
    plans = model.body_plans
    if len(plans) >= _PLANS_PER_MODEL:
        plans.clear()
    plan = plans[layout] = Plan(tuple(data), limits, tuple(arrays), None if lens is None else lens.shape,
                                 "valid_lens" in model.input_names, lengths, {})
    return plan.memo
