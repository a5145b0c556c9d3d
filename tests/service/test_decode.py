"""The decoder's paths agree: the whole-body structural check (small bodies), the row walk (large
ones) and the precise walk (Python lists) give the same arrays for every valid body, and every bad
body gets the same error from each."""

import json
import zlib

import numpy as np
import pytest

import service.decode as decode
from service.errors import ServiceError
from service.runtime import Registry
from tests.service.test_bad_input import CASES


@pytest.fixture(scope="module")
def registry(repository):
    return Registry.load(repository, "cpu", 1)


def _paths(monkeypatch, body, registry):
    """The result (or error) of each path for `body`."""
    results = {}
    for name, small, walk in (("small-body", 1 << 30, True), ("row walk", 0, True), ("precise", 0, False)):
        monkeypatch.setattr(decode, "_SMALL_BODY", small)
        if not walk:  # no fast array at all: every field the precise way
            monkeypatch.setattr(decode, "_fast_array", lambda node: None)
        try:
            request = decode.decode_body(body, registry)
            results[name] = {k: (v.dtype, v.shape, v.tobytes()) for k, v in request.feed.items()}
        except ServiceError as e:
            results[name] = (type(e).__name__, e.status, e.body())
    monkeypatch.undo()
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
        assert results["small-body"] == results["row walk"] == results["precise"], body[:200]
        assert isinstance(results["small-body"], dict), results["small-body"]


@pytest.mark.parametrize("case", [c for c in CASES if isinstance(c[1], dict | bytes)], ids=lambda c: c[0])
def test_every_path_gives_the_same_error(registry, monkeypatch, case):
    body = case[1] if isinstance(case[1], bytes) else json.dumps(case[1]).encode()
    results = _paths(monkeypatch, body, registry)
    assert results["small-body"] == results["row walk"] == results["precise"]


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
    assert results["small-body"] == results["row walk"] == results["precise"]


def test_the_small_body_path_is_taken_for_valid_bodies():
    """Otherwise the comparisons above would compare the long way with itself."""
    rng = np.random.default_rng(0)
    for kind in ("dot_product", "additive", "multi_head", "self_attention"):
        for style in ("compact", "indented", "integers", "exponents"):
            body = _random_body(rng, kind, style)
            data = decode.parse(body)
            fields = [f for f in ("queries", "keys", "values", "valid_lens") if data.get(f) is not None]
            assert decode._small_body_arrays(body, data, fields) is not None, body[:200]
