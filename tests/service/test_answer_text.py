"""A large answer in JSON (service.protocols.codec.json_parts): orjson's bytes to the byte, written a part at
a time and not joined, so that the thread writing it lets the event loop's thread run between parts (orjson
holds the GIL for a whole call; so does a join of the parts)."""

from __future__ import annotations

import sys

import numpy as np
import orjson
import pytest

from service.protocols.codec import TEXT_AT_ONCE, dumps, json_parts
from tests.load.gil import longest_wait

SHAPES = [(2, 3), (1, 300, 700), (3, 200, 70), (100_000,), (2, 5, 4000, 2), (40_000, 1), (1, TEXT_AT_ONCE + 1),
          (0, 5), (5, 0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_bytes_are_orjsons(shape):
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    array.flat[:3] = [np.float32(1e-45), np.float32(-3.4e38), np.float32(0.1)][:array.size]
    for value in (array, {"model": "m", "model_version": "1", "outputs": array, "attention_weights": None, "e": {}},
                  {"model_name": "m", "outputs": [{"name": "outputs", "shape": list(shape), "data": array.ravel()}],
                   "l": []}):
        parts = json_parts(value, array.size)
        assert (parts.__class__ is list) == (array.size > TEXT_AT_ONCE)
        assert dumps(value, array.size) == orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def test_a_thread_writing_a_large_answer_lets_another_run():
    """The longest the main thread waits for the GIL while another writes 2 x 1.5 M numbers: a part's time
    (plus the switch interval the service sets), not the whole answer's as with one call of orjson."""
    rng = np.random.default_rng(0)
    body = {"outputs": rng.standard_normal((1, 1024, 1536), dtype=np.float32),
            "attention_weights": rng.random((1, 1024, 1536), dtype=np.float32)}
    numbers = 2 * 1024 * 1536

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # the service's (service.core.dataplane)
    try:
        whole, whole_took, _ = longest_wait(lambda: orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))
        # The best of three: on a loaded 2-core host the OS may park either thread for longer than a part.
        parts, parts_took, _ = min((longest_wait(lambda: json_parts(body, numbers)) for _ in range(3)),
                                   key=lambda waited: waited[0])
    finally:
        sys.setswitchinterval(interval)
    assert whole > 0.6 * whole_took  # one call: the main thread waited for (nearly) all of it
    assert parts < whole / 8 and parts < 0.1 * parts_took, (parts, whole, parts_took)
