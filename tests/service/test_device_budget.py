"""ATTEND_MAX_DEVICE_BYTES: a run's memory in the execution provider is counted before it runs, as the in-flight
budget counts host memory; a request over all of it gets a 413 that names the setting, and the next is served.
On the CPU the budget applies where it is set (the GPU's own test is in tests/service/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

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


def test_the_device_budget_is_exported_and_read_at_scrape_time(budgeted):
    client, limit = budgeted
    budget = client.app.state.dataplane.device_budget
    families = {f.name: f.samples for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert [s.value for s in families["attend_device_bytes_limit"]] == [limit]
    assert [s.value for s in families["attend_device_bytes"]] == [0]  # nothing in flight between requests
    budget.used = 4321
    try:
        assert "\nattend_device_bytes 4321.0\n" in client.get("/metrics").text
    finally:
        budget.used = 0


def test_without_the_setting_the_cpu_has_no_device_budget(client):
    assert client.app.state.dataplane.device_budget is None
    assert client.post("/attend", json=dot_product_body(128)).status_code == 200
    assert "attend_device_bytes" not in client.get("/metrics").text  # no budget, no gauges


GIB = 1 << 30


@pytest.mark.parametrize(("cores", "device", "gpu_gib", "workers"), [
    (16, "cpu", None, 16),  # one a core
    (16, "auto", None, 16),  # no GPU that NVML sees
    (16, "cuda", None, 8),  # a GPU of unknown memory: the most measured
    (16, "auto", 80, 8),  # an H100: 16 would fit, 8 is the most measured
    (16, "auto", 24, 4),  # an L4: 19.2 GiB hold 4 x (3 + 1)
    (16, "cuda", 16, 3),  # a T4: 8 x 2.4 GiB (the H200's measure) pass it
    (4, "auto", 80, 4),  # fewer cores than the GPU holds
    (16, "cuda", 4, 1),  # none fits: one all the same
])
def test_auto_workers_are_the_cores_and_what_the_gpu_holds(cores, device, gpu_gib, workers):
    from service.core.gpu import MIN_BUDGET, SHARE, WORKER_BYTES, auto_workers

    gpu = None if gpu_gib is None else gpu_gib * GIB
    assert auto_workers(cores, device, gpu) == workers
    if gpu is not None and workers > 1:  # each worker keeps at least the least budget: device_budget's floor holds
        assert workers * (WORKER_BYTES + MIN_BUDGET) <= SHARE * gpu


def test_workers_auto_is_a_number_in_the_settings(monkeypatch):
    from pydantic import ValidationError

    from service.config import Settings, usable_cores

    assert Settings(workers="auto", device="cpu").workers == usable_cores()
    monkeypatch.setenv("ATTEND_WORKERS", " Auto ")
    monkeypatch.setenv("ATTEND_DEVICE", "cpu")
    assert Settings().workers == usable_cores()  # from the environment (get_settings keeps its first)
    with pytest.raises(ValidationError, match="workers"):
        Settings(workers="many")
    with pytest.raises(ValidationError, match=r"a number of processes \(1 or more\), or auto"):
        Settings(workers="auto<script>")


def test_a_gpu_memory_that_cannot_be_read_is_said(caplog):
    """Without NVML (no nvidia-ml-py, no driver) the log says so and what follows: the GPU image lacked the
    library, and its budget was off without a word."""
    from service.core.gpu import total_memory

    with caplog.at_level("DEBUG", logger="service"):
        total = total_memory(None)
        if total is not None:
            pytest.skip("NVML reads a GPU here: tests/service/test_gpu.py checks what follows")
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        assert total_memory() is None
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warning.getMessage().startswith("cannot read the GPU's memory (")
    assert warning.getMessage().endswith("): no GPU memory budget unless ATTEND_MAX_DEVICE_BYTES is set")
