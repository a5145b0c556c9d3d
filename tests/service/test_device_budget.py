"""ATTEND_MAX_DEVICE_BYTES: a run's memory in the execution provider is counted before it runs, as the in-flight
budget counts host memory; a request over all of it gets a 413 that names the setting, and the next is served.
On the CPU the budget applies where it is set (the GPU's own test is in tests/service/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.core.cost import device_run
from service.http.app import create_app


def dot_product_body(n: int, d: int = 8) -> dict:
    rng = np.random.default_rng(n)
    return {"model": "dot_product",
            "queries": rng.normal(size=(1, n, d)).round(3).tolist(),
            "keys": rng.normal(size=(1, n, d)).round(3).tolist(),
            "values": rng.normal(size=(1, n, 4)).round(3).tolist(),
            "valid_lens": [n]}


def run_bytes(n: int, d: int = 8) -> int:
    inputs = n * d * 2 + n * 4 + n  # queries, keys, values, and the lengths made 2-D (one a query)
    return device_run(inputs, n * 4 + n * n, n * n)


@pytest.fixture(scope="module")
def budgeted(settings):
    limit = run_bytes(64)  # a 64 x 64 request fits; a 128 x 128 one never does
    with TestClient(create_app(settings.model_copy(update={"max_device_bytes": limit}))) as client:
        yield client, limit


def test_a_run_over_the_device_budget_is_refused_before_it_runs_and_the_next_is_served(budgeted):
    client, limit = budgeted
    app = client.app
    ran_before = app.state.dataplane.metrics.batch_requests.labels("dot_product")._sum.get()
    refused = client.post("/attend", json=dot_product_body(128))
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "payload_too_large"
    assert f"would take {run_bytes(128)} bytes of the execution provider's memory" in error["message"]
    assert "ATTEND_MAX_DEVICE_BYTES" in error["message"] and error["expected"] == f"<= {limit}"
    assert app.state.dataplane.metrics.batch_requests.labels("dot_product")._sum.get() == ran_before  # never ran
    served = client.post("/attend", json=dot_product_body(64))
    assert served.status_code == 200, served.text
    assert np.asarray(served.json()["outputs"]).shape == (1, 64, 4)
    assert app.state.dataplane.device_budget.used == 0  # given back


def test_without_the_setting_the_cpu_has_no_device_budget(client):
    assert client.app.state.dataplane.device_budget is None
    assert client.post("/attend", json=dot_product_body(128)).status_code == 200
