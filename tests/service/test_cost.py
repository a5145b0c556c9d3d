"""service.core.cost's arithmetic: the two ways of counting a JSON body agree, a small body's bound from
its size covers what counting it would give, and a request's share of the budget grows, shrinks and is
refused as documented. (What the counts bound in resident memory: tests/service/test_bounded.py and
tests/load/membound.py, against the real process.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.core.cost import SMALL_JSON_BYTES, Budget, Cost, json_counts, json_decode, json_expected
from service.core.errors import Overloaded, PayloadTooLarge


def _bodies():
    rng = np.random.default_rng(0)
    yield b"{}"
    yield b"[" * 1000 + b"]" * 1000
    yield b"[0," * 600 + b"0" + b"]" * 600
    yield b'{"a": "' + b",[" * 900 + b'"}'
    for size in (1, 3, 40, 300):
        yield json.dumps({"queries": rng.normal(size=(1, size, 2)).tolist(), "valid_lens": [1]}).encode()


@pytest.mark.parametrize("body", list(_bodies()), ids=lambda b: f"{len(b)}B")
def test_counting_agrees_across_sizes_and_small_bodies_are_bounded_from_their_size(body):
    padded = body + b" " * 5000  # past bytes.count's range: NumPy's way
    assert json_counts(body) == json_counts(padded) == (body.count(b","), body.count(b"["))
    assert json_counts(memoryview(body)) == json_counts(body)
    if len(body) <= SMALL_JSON_BYTES:
        assert json_expected(len(body)) >= json_decode(len(body), *json_counts(body))
    assert json_expected(SMALL_JSON_BYTES + 1) == json_decode(SMALL_JSON_BYTES + 1, 0, 0)


def test_a_share_grows_shrinks_and_is_refused_whole():
    budget = Budget(1000)
    first, second = Cost(budget), Cost(budget)
    first.hold(600)
    with pytest.raises(Overloaded) as refused:
        second.hold(500)
    assert refused.value.headers == {"Retry-After": "1"} and budget.used == 600 and second.held == 0
    with pytest.raises(PayloadTooLarge):
        second.hold(1001)
    first.hold(200)  # shrinks: gives 400 back
    second.hold(500)
    second.at_least(100)  # holds more already: nothing changes
    assert (budget.used, first.peak, second.held) == (700, 600, 500)
    first.release()
    second.release()
    assert budget.used == 0


def test_a_rough_bound_is_held_only_while_half_the_budget_stays_free():
    budget = Budget(1000)
    first, second = Cost(budget), Cost(budget)
    assert first.roughly(400) and budget.used == 400
    assert not second.roughly(200) and second.held == 0 and budget.used == 400  # 600 > 500: count instead
    assert second.roughly(100) and first.roughly(300)  # holds more already: True, nothing changes
    assert (budget.used, first.held, second.held) == (500, 400, 100)
