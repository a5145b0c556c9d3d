"""The decoder's paths agree: the whole-body structural check (small bodies), a plan left by an
earlier body of the same layout, the row walk (large ones) and the precise walk (Python lists) give
the same arrays for every valid body, and every bad body gets the same error from each."""

import json
import re
import zlib

import numpy as np
import pytest
import simdjson

import service.protocols.attend as decode
import service.protocols.json_arrays as json_arrays
import service.protocols.layouts as layouts
from service.core.errors import ServiceError
from service.core.runtime import Registry
from tests.service.test_bad_input import CASES, TOY


@pytest.fixture(scope="module")
def registry(repository):
    return Registry.load(repository, "cpu", 1)


def sibling(body: bytes) -> bytes:
    """A body of the same layout (keys, shapes, types) with other numbers: every digit but 0 a 1
    (whole numbers stay whole, and lengths stay within n_k)."""
    return re.sub(rb"[2-9]", b"1", body)


def forget_plans(registry):
    for name in registry.names():
        registry.get(name).body_plans.clear()
        registry.get(name).body_layouts_seen.clear()


LIMITS = decode.RequestLimits()  # one object: a plan holds for the limits object it was checked against


def _result(body, registry, limits=LIMITS):
    try:
        request = decode.decode_body(body, registry, limits)
        return {k: (v.dtype, v.shape, v.tobytes()) for k, v in request.feed.items()} | {
            "return_weights": request.return_weights, "model": request.model.name}
    except ServiceError as e:
        return (type(e).__name__, e.status, e.body())


def _paths(monkeypatch, body, registry):
    """The result (or error) of each path for `body`; "planned": after a sibling body left its plan
    (where it passed), and whether it did."""
    results = {}
    for name, small, walk in (("small-body", 1 << 30, True), ("planned", 1 << 30, True), ("row walk", 0, True),
                              ("precise", 0, False)):
        forget_plans(registry)
        monkeypatch.setattr(decode, "SMALL_BODY", small)
        if not walk:  # no fast array at all: every field the precise way
            monkeypatch.setattr(json_arrays, "fast_array", lambda node: None)
        if name == "planned":  # a layout gets its plan the second time it comes
            _result(sibling(body), registry)
            _result(sibling(body), registry)
            results["had a plan"] = any(registry.get(n).body_plans for n in registry.names())
        results[name] = _result(body, registry)
    monkeypatch.undo()
    forget_plans(registry)
    return results


def _random_body(rng, kind, style):
    batch, n_q, n_k = (int(x) for x in rng.integers(1, 6, size=3))
    if kind == "self_attention":
        n_k = n_q
    # query, key and value sizes
    size = {"additive": (20, 2, 3), "multi_head": (100, 100, 100), "self_attention": (100,)}.get(kind, (4, 4, 3))

    def arr(*shape):
        values = rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4)
        if style == "integers":
            values = np.round(values)
        return values.tolist() if style != "integers" else values.astype(int).tolist()

    body = {"model": kind, "queries": arr(batch, n_q, size[0])}
    if kind != "self_attention":
        body |= {"keys": arr(batch, n_k, size[1]), "values": arr(batch, n_k, size[2])}
    form = rng.integers(0, 4)
    if form == 1:
        body["valid_lens"] = rng.integers(0, n_k + 1, size=batch).tolist()
    elif form == 2:
        body["valid_lens"] = rng.integers(0, n_k + 1, size=(batch, n_q)).astype(float).tolist()
    elif form == 3:
        body["valid_lens"] = None
    if style == "indented":
        return json.dumps(body, indent=2).encode()
    if style == "exponents":
        return json.dumps(body).replace("e-0", "E-0").encode()
    return json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.parametrize("style", ["compact", "indented", "integers", "exponents"])
@pytest.mark.parametrize("kind", ["dot_product", "additive", "multi_head", "self_attention"])
def test_every_path_gives_the_same_arrays(registry, monkeypatch, kind, style):
    rng = np.random.default_rng(zlib.crc32(f"{kind} {style}".encode()))
    for _ in range(5):
        body = _random_body(rng, kind, style)
        results = _paths(monkeypatch, body, registry)
        assert results["small-body"] == results["planned"] == results["row walk"] == results["precise"], body[:200]
        assert isinstance(results["small-body"], dict), results["small-body"]
        assert results["had a plan"], body[:200]


@pytest.mark.parametrize("case", [c for c in CASES if isinstance(c[1], dict | bytes)], ids=lambda c: c[0])
def test_every_path_gives_the_same_error(registry, monkeypatch, case):
    body = case[1] if isinstance(case[1], bytes) else json.dumps(case[1]).encode()
    results = _paths(monkeypatch, body, registry)
    assert results["small-body"] == results["planned"] == results["row walk"] == results["precise"]


@pytest.mark.parametrize("body", [
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [[2]]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[[]], [2, 3]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3]]], "values": [[[1], [2]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, "4"]]], "values": [[[1], [2]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]], '
    b'"valid_lens": [[1, [2]]]}',
    b'{"model": "dot_\\u0070roduct", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]]}',
])
def test_what_flattening_would_hide_is_caught_by_every_path(registry, monkeypatch, body):
    """as_buffer flattens nested arrays: a row [1, [2]] has two numbers like [1, 2]. The structural
    checks (whole body, or brackets counted) must not let it through."""
    results = _paths(monkeypatch, body, registry)
    assert results["small-body"] == results["planned"] == results["row walk"] == results["precise"]


def test_the_small_body_path_is_taken_for_valid_bodies():
    """Otherwise the comparisons above would compare the long way with itself."""
    rng = np.random.default_rng(0)
    for kind in ("dot_product", "additive", "multi_head", "self_attention"):
        for style in ("compact", "indented", "integers", "exponents"):
            body = _random_body(rng, kind, style)
            data = json_arrays.parse(body, decode.FIELDS)
            fields = [f for f in ("queries", "keys", "values", "valid_lens") if data.get(f) is not None]
            assert json_arrays.small_body_arrays(json_arrays.skeleton(body), data, fields) is not None, body[:200]


# ------------------------------------------------------------------------------------------- plans


def _toy(**changes) -> bytes:
    return json.dumps(TOY | changes).encode()


def test_a_plan_is_left_by_a_valid_small_body_whose_layout_came_before_and_used_by_the_next(registry, monkeypatch):
    forget_plans(registry)
    model = registry.get("additive")
    first, second = _toy(), sibling(_toy())
    expected = _result(second, registry)
    forget_plans(registry)
    assert _result(first, registry)["model"] == "additive"
    assert not model.body_plans  # a layout seen once: no plan yet
    assert _result(first, registry)["model"] == "additive"
    assert list(model.body_plans) == [json_arrays.skeleton(first)] == [json_arrays.skeleton(second)]
    used = []
    real = layouts.Plan.request
    monkeypatch.setattr(layouts.Plan, "request", lambda plan, *a: used.append(plan) or real(plan, *a))
    assert _result(second, registry) == expected
    assert len(used) == 1
    # Another layout (one key row fewer) is decoded the long way, and leaves its own plan when it comes again.
    other = _toy(keys=TOY["keys"][:1], values=TOY["values"][:1], queries=TOY["queries"][:1], valid_lens=[2])
    assert isinstance(_result(other, registry), dict)
    assert len(used) == 1 and len(model.body_plans) == 1
    assert isinstance(_result(other, registry), dict)
    assert len(used) == 1 and len(model.body_plans) == 2


def test_layouts_that_never_come_again_leave_no_plans_and_what_is_seen_is_bounded(registry):
    forget_plans(registry)
    model = registry.get("dot_product")
    for n in range(1, 3 * layouts._LAYOUTS_SEEN):
        body = {"model": "dot_product", "queries": [[[1.0]]], "keys": [[[1.0]] * n], "values": [[[1.0]] * n]}
        assert isinstance(_result(json.dumps(body).encode(), registry), dict)
        assert not model.body_plans
        assert 1 <= len(model.body_layouts_seen) <= layouts._LAYOUTS_SEEN
    forget_plans(registry)


def test_what_numbers_can_get_wrong_is_checked_on_a_plan_too(registry):
    """A layout that passed once: the same keys and shapes with a number that fails gets the long
    way's own error (the plan's path checks finite float32 and the valid lengths' values; the model
    and version come from each body)."""
    base = dict(TOY, version=1)
    cases = [
        dict(base, valid_lens=[2, 11]),  # over n_k = 10
        dict(base, valid_lens=[2, 1.5]),  # not whole
        dict(base, valid_lens=[-1, 2]),
        dict(base, version=2),  # not loaded
        dict(base, version=1.5),
        dict(base, queries=[[[1e39] * 20]] * 2),  # beyond float32
        dict(base, keys=[[[1.0, -1e300]] * 10] * 2),
        dict(base, keys=[[[10**40, 1]] * 10] * 2),  # beyond 64 bits: simdjson refuses it, orjson parses it
    ]
    for body in cases:
        raw = json.dumps(body).encode()
        forget_plans(registry)
        expected = _result(raw, registry)
        assert isinstance(expected, tuple), body
        valid = json.dumps(dict(base, version=len(body["queries"]) // 2)).encode()  # valid, the same layout
        _result(valid, registry)
        _result(valid, registry)
        assert registry.get("additive").body_plans, body
        assert _result(raw, registry) == expected, body
    forget_plans(registry)


def test_a_plan_holds_for_the_limits_it_was_checked_against(registry):
    forget_plans(registry)
    body = _toy()
    assert isinstance(_result(body, registry), dict)
    small = decode.RequestLimits(batch=1)
    assert _result(body, registry, small)[:2] == ("PayloadTooLarge", 413)
    forget_plans(registry)


def test_plans_are_bounded(registry):
    forget_plans(registry)
    model = registry.get("dot_product")
    for n in range(1, 3 * layouts._PLANS_PER_MODEL):
        body = json.dumps({"model": "dot_product", "queries": [[[1.0]]], "keys": [[[1.0]] * n],
                           "values": [[[1.0]] * n]}).encode()
        assert isinstance(_result(body, registry), dict)
        assert isinstance(_result(body, registry), dict)
        assert 1 <= len(model.body_plans) <= layouts._PLANS_PER_MODEL
    forget_plans(registry)


def test_a_small_body_parses_on_its_threads_parser_and_a_busy_parser_gives_way(registry, monkeypatch):
    """A small body's parse reuses its thread's parser (made once); while proxies of the last document it
    parsed are alive (here `first`'s), the next body takes a fresh parser, and both documents stay readable.
    A body over 64 KB takes a fresh one."""
    made = []
    real = simdjson.Parser
    monkeypatch.setattr(json_arrays.simdjson, "Parser", lambda: made.append(1) or real())
    monkeypatch.setattr(json_arrays._threads, "parser", None, raising=False)
    for _ in range(3):
        assert json_arrays.parse(b'{"queries": [[[1.0]]]}', decode.FIELDS)["queries"].as_list() == [[[1.0]]]
    assert len(made) == 1  # the thread's, once
    first = json_arrays.parse(b'{"queries": [[[1.0, 2.0]]]}', decode.FIELDS)
    second = json_arrays.parse(b'{"keys": [[[3.0]]]}', decode.FIELDS)
    assert len(made) == 2  # `first` holds the thread's: a fresh one
    assert type(first["queries"]) is type(second["keys"]) is simdjson.Array  # neither the slow way
    assert first["queries"].as_list() == [[[1.0, 2.0]]] and second["keys"].as_list() == [[[3.0]]]
    del first, second
    third = json_arrays.parse(b'{"values": [[[4.0]]]}', decode.FIELDS)  # the thread's parser, free again
    assert len(made) == 2
    large = json_arrays.parse(b'{"values": [[[' + b",".join([b"1.0"] * 20_000) + b']]]}', decode.FIELDS)
    assert len(made) == 3 and large["values"].as_list()[0][0][:2] == [1.0, 1.0]
    assert type(third["values"]) is simdjson.Array and third["values"].as_list() == [[[4.0]]]


def _feed_cases(model, rng):
    """Tensors for `model`'s float inputs: its signature's shapes, and each way one of them can be off
    (a fixed size, a named axis that disagrees, an empty or a 2-D array, a non-finite number, sizes at
    and past each limit, an odd positional d, n past max_len)."""
    specs = [s for s in model.inputs() if s.name != "valid_lens"]
    for _ in range(60):
        sizes = {axis: int(rng.integers(1, 7)) for s in specs for axis in s.shape if axis.__class__ is str}
        if model.kind == "positional_encoding":
            sizes["d"] += sizes["d"] % 2
        if rng.random() < 0.3:  # large enough for the limits below
            sizes[rng.choice(sorted(sizes))] = int(rng.integers(7, 40))
        max_len = model.config.hyperparameters.get("max_len")
        if max_len is not None and rng.random() < 0.1:
            sizes["n"] = max_len + int(rng.integers(0, 2))
        shapes = {s.name: [sizes[a] if a.__class__ is str else a for a in s.shape] for s in specs}
        tensors = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
        yield tensors
        name = specs[int(rng.integers(len(specs)))].name
        for off in ("axis", "empty", "2-D", "inf"):
            bad = dict(tensors)
            arr = bad[name]
            if off == "axis":
                axis = int(rng.integers(arr.ndim))
                arr = np.zeros(arr.shape[:axis] + (arr.shape[axis] + 1,) + arr.shape[axis + 1:])
            elif off == "empty":
                arr = arr[:, :0]
            elif off == "2-D":
                arr = arr[0]
            else:
                arr = arr.copy()
                arr.flat[0] = 1e39  # beyond float32
            bad[name] = arr
            yield bad


def test_the_signatures_one_check_agrees_with_the_long_way(registry):
    """request._FeedPlan's check of a request's float inputs (one pass, once per snapshot's signature)
    passes exactly what the long way (_checked_feed_long, axis by axis, naming the field) passes, with the
    same feed and lengths, under several limits, for casts by it and for checked float32; where it does
    not, the long way raises."""
    from service.core import request

    rng = np.random.default_rng(7)
    limits = [decode.RequestLimits(), decode.RequestLimits(batch=3, sequence=5, features=20, weight_elements=200),
              decode.RequestLimits(sequence=30, features=6, weight_elements=2000),
              decode.RequestLimits(features=200, weight_elements=300)]
    passed = failed = 0
    for name in registry.names():
        model = registry.get(name)
        plan = request._FeedPlan.of(model)
        for tensors in _feed_cases(model, rng):
            for limit in limits:
                for checked in (False, True):
                    given = {k: v.astype(np.float32) if checked else v for k, v in tensors.items()}
                    if checked and not all(np.isfinite(v).all() for v in given.values()):
                        continue  # the caller vouches for finite float32
                    fast = plan.check(given, limit, checked)
                    try:
                        long = request._checked_feed_long(model, given, limit, checked)
                    except ServiceError:
                        assert fast is None, (name, {k: v.shape for k, v in given.items()}, limit)
                        failed += 1
                        continue
                    assert fast is not None, (name, {k: v.shape for k, v in given.items()}, limit)
                    assert fast[1] == long[1] and fast[0].keys() == long[0].keys()
                    for key, arr in long[0].items():
                        assert fast[0][key].dtype == arr.dtype == np.float32
                        assert np.array_equal(fast[0][key], arr)
                    passed += 1
    assert passed > 300 and failed > 300, (passed, failed)
