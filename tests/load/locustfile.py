"""Locust load test of POST /attend: a realistic mix, and a check of every response's shapes.

    locust -f tests/load/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000

The mix: the book's toy requests, random shapes for every model, absent/1-D/2-D valid lengths,
and a few bad requests whose 4xx is expected (counted as a success when the status and error
field are the expected ones, as a failure otherwise). Bodies are made up front (a pool per
kind) so the load generator spends its CPU on HTTP, not on random numbers.
"""

from __future__ import annotations

import json
import random

import numpy as np
from locust import FastHttpUser, between, events, task

POOL = 64
_rng = np.random.default_rng(0)


def _lens(batch: int, n_q: int, n_k: int) -> list | None:
    form = _rng.integers(0, 3)
    if form == 0:
        return None
    shape = (batch,) if form == 1 else (batch, n_q)
    return _rng.integers(0, n_k + 1, size=shape).tolist()


def _arr(*shape: int) -> list:
    return np.round(_rng.normal(size=shape), 4).tolist()


def toy() -> dict:
    values = np.arange(40, dtype=float).reshape(1, 10, 4).repeat(2, axis=0)
    return {"model": "additive", "queries": _arr(2, 1, 20), "keys": np.ones((2, 10, 2)).tolist(),
            "values": values.tolist(), "valid_lens": [2, 6]}


def dot_product() -> dict:
    b, n_q, n_k, d, v = (int(x) for x in _rng.integers(1, 17, size=5))
    return {"model": "dot_product", "queries": _arr(b, n_q, d), "keys": _arr(b, n_k, d), "values": _arr(b, n_k, v),
            "valid_lens": _lens(b, n_q, n_k)}


def additive() -> dict:
    b, n_q, n_k, v = (int(x) for x in _rng.integers(1, 13, size=4))
    return {"model": "additive", "queries": _arr(b, n_q, 20), "keys": _arr(b, n_k, 2), "values": _arr(b, n_k, v),
            "valid_lens": _lens(b, n_q, n_k)}


def multi_head() -> dict:
    b, n_q, n_k = (int(x) for x in _rng.integers(1, 9, size=3))
    return {"model": "multi_head", "queries": _arr(b, n_q, 100), "keys": _arr(b, n_k, 100),
            "values": _arr(b, n_k, 100), "valid_lens": _lens(b, n_q, n_k)}


def self_attention() -> dict:
    b, n = (int(x) for x in _rng.integers(1, 17, size=2))
    return {"model": "self_attention", "queries": _arr(b, n, 100), "valid_lens": _lens(b, n, n)}


def expected_shapes(body: dict) -> tuple[list[int], list[int]]:
    q = np.shape(body["queries"])
    batch, n_q = q[0], q[1]
    model = body["model"]
    if model == "self_attention":
        return [batch, n_q, 100], [batch, 5, n_q, n_q]
    n_k = np.shape(body["keys"])[1]
    out = {"dot_product": np.shape(body["values"])[2], "additive": np.shape(body["values"])[2],
           "multi_head": 100}[model]
    weights = [batch, 5, n_q, n_k] if model == "multi_head" else [batch, n_q, n_k]
    return [batch, n_q, out], weights


def _pool(make) -> list[tuple[bytes, tuple[list[int], list[int]]]]:
    bodies = [make() for _ in range(POOL)]
    return [(json.dumps(b).encode(), expected_shapes(b)) for b in bodies]


# (body, expected status, expected error field)
BAD = [
    (json.dumps(toy() | {"valid_lens": [2, 11]}).encode(), 422, "valid_lens"),
    (json.dumps(toy() | {"keys": [[[1.0, 1.0, 1.0]] * 10] * 2}).encode(), 422, "keys"),
    (json.dumps(toy() | {"model": "nope"}).encode(), 404, "model"),
    (b'{"queries": [[[1.0, 2.0], [3.0]]], "keys": [[[1.0, 2.0]]], "values": [[[1.0]]]}', 422, "queries"),
]
POOLS: dict[str, list] = {}


@events.init.add_listener
def _make_pools(**_kwargs) -> None:
    for make in (toy, dot_product, additive, multi_head, self_attention):
        POOLS[make.__name__] = _pool(make)


def _shape(nested) -> list[int]:
    shape = []
    while isinstance(nested, list):
        shape.append(len(nested))
        nested = nested[0] if nested else None
    return shape


HEADERS = {"content-type": "application/json"}


def _said(response) -> str:
    """The start of what the service answered; for status 0 (no answer: refused, reset, timed out), the
    client's error."""
    return (response.text if response.text is not None else repr(response.error))[:200]


class AttendUser(FastHttpUser):
    wait_time = between(0.0, 0.05)

    def _attend(self, kind: str) -> None:
        body, (out_shape, w_shape) = random.choice(POOLS[kind])
        with self.client.post("/attend", data=body, headers=HEADERS, name=f"/attend {kind}",
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {_said(response)}")
                return
            got = response.json()
            if _shape(got["outputs"]) != out_shape or _shape(got["attention_weights"]) != w_shape:
                response.failure(f"shapes {_shape(got['outputs'])}, {_shape(got['attention_weights'])}; "
                                 f"expected {out_shape}, {w_shape}")

    @task(4)
    def toy(self) -> None:
        self._attend("toy")

    @task(3)
    def dot_product(self) -> None:
        self._attend("dot_product")

    @task(2)
    def additive(self) -> None:
        self._attend("additive")

    @task(2)
    def multi_head(self) -> None:
        self._attend("multi_head")

    @task(2)
    def self_attention(self) -> None:
        self._attend("self_attention")

    @task(1)
    def bad_request(self) -> None:
        body, status, field = random.choice(BAD)
        with self.client.post("/attend", data=body, headers=HEADERS, name=f"/attend bad ({status})",
                              catch_response=True) as response:
            error = response.json().get("error", {}) if (response.text or "").startswith("{") else {}
            if response.status_code == status and error.get("field") == field:
                response.success()  # the expected 4xx
            else:
                response.failure(f"expected {status} on {field}, got {response.status_code}: {_said(response)}")
