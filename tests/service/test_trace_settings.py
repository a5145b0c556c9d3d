"""Triton's trace extension (GET/POST /v2[/models/{m}]/trace/setting, gRPC's TraceSetting) against the real
process tracing to a receiver in this process (tests/otlp.py), with tritonclient: trace_rate and trace_count
choose which requests are traced, a model's settings override the global ones and null clears them, over HTTP
and gRPC; refusals name the setting; reading takes the API key, changing an admin's; OFF while OTEL_* has
tracing off; with ATTEND_WORKERS=2 a count is one for both workers."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.otlp import Receiver
from tests.server import free_port, running_service
from tests.service.test_tracing import traceparent

pytestmark = pytest.mark.slow

KEY, ADMIN = "trace-key", "trace-admin"
DEFAULTS = {"trace_file": "", "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
            "log_frequency": "0", "trace_mode": "opentelemetry"}
SHAPES = {"additive": (20, 2), "dot_product": (2, 2)}  # a query's and a key's size


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


def _inputs(module, model):
    q, k = SHAPES[model]
    arrays = {"queries": np.ones((1, 1, q), np.float32), "keys": np.ones((1, 3, k), np.float32),
              "values": np.arange(12, dtype=np.float32).reshape(1, 3, 4)}
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _traced(receiver, client, module, model, n, headers=None) -> list[bool]:
    """Which of `n` requests to `model`, each with a sampled traceparent of its own, reached the receiver."""
    ids = []
    for _ in range(n):
        parent, trace_id, _ = traceparent()
        result = client.infer(model, _inputs(module, model), headers={"traceparent": parent, **(headers or {})})
        assert result.as_numpy("outputs").shape == (1, 1, 4)
        ids.append(trace_id)
    time.sleep(0.4)  # the spans leave every 50 ms (OTEL_BSP_SCHEDULE_DELAY)
    with receiver.lock:
        seen = {s.trace_id for s in receiver.spans if s.kind == "SERVER"}
    return [i in seen for i in ids]


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_rate_count_and_a_models_settings_choose_what_is_traced(repository, receiver, protocol):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_ADMIN_KEYS=ADMIN,
                         OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        admin = {"authorization": f"Bearer {ADMIN}"}
        module = httpclient if protocol == "http" else grpcclient
        client = httpclient.InferenceServerClient(url.removeprefix("http://")) if protocol == "http" else \
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}")

        def settings(model=None):
            got = client.get_trace_settings(model)
            if protocol == "grpc":
                got = {k: list(v.value) for k, v in got.settings.items()}
                got = {k: v if k == "trace_level" else v[0] for k, v in got.items()}
            return got

        def update(changes, model=None):
            client.update_trace_settings(model, changes, headers=admin)
            return settings(model)

        assert "trace" in httpx.get(f"{url}/v2").json()["extensions"]
        assert settings() == settings("additive") == DEFAULTS
        assert _traced(receiver, client, module, "additive", 2) == [True, True]
        assert update({"trace_rate": "3"}) == DEFAULTS | {"trace_rate": "3"}
        assert _traced(receiver, client, module, "additive", 6) == [False, False, True] * 2
        assert update({"trace_rate": "1", "trace_count": "2"}) == DEFAULTS | {"trace_count": "2"}
        assert _traced(receiver, client, module, "additive", 4) == [True, True, False, False]
        assert settings()["trace_count"] == "0"
        update({"trace_count": "-1"})
        # A model's own: the others keep the global settings; null clears it.
        assert update({"trace_level": ["OFF"]}, "dot_product") == DEFAULTS | {"trace_level": ["OFF"]}
        assert settings() == settings("additive") == DEFAULTS
        assert _traced(receiver, client, module, "dot_product", 2) == [False, False]
        assert _traced(receiver, client, module, "additive", 1) == [True]
        assert update({"trace_level": None}, "dot_product") == DEFAULTS
        assert _traced(receiver, client, module, "dot_product", 1) == [True]
        # Off for every model, then on again.
        assert update({"trace_level": "OFF"})["trace_level"] == ["OFF"]
        assert _traced(receiver, client, module, "additive", 2) == [False, False]
        assert update({"trace_level": None}) == DEFAULTS


def test_refusals_name_the_setting_and_changing_is_an_admin_call(repository, receiver):
    with running_service(repository, ATTEND_API_KEYS=KEY, ATTEND_ADMIN_KEYS=ADMIN,
                         OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint) as (url, _):
        user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
        setting = f"{url}/v2/trace/setting"
        assert httpx.get(setting).status_code == 401
        assert httpx.get(setting, headers=user).json() == DEFAULTS
        assert httpx.post(setting, json={"trace_rate": "2"}, headers=user).status_code == 401
        for body, said in [({"trace_nothing": "1"}, "trace_nothing is not a trace setting; they are trace_file"),
                           ({"trace_rate": "0"}, "trace_rate must be an integer, 1 or more"),
                           ({"trace_rate": True}, "trace_rate must be a string"),
                           ({"trace_count": "-2"}, "trace_count must be an integer, -1 or more"),
                           ({"trace_count": "1", "trace_rate": "x"}, "trace_rate must be an integer"),
                           ({"trace_level": ["TENSORS"]}, "trace_level TENSORS is not traced"),
                           ({"trace_level": ["OFF", "TIMESTAMPS"]}, "trace_level must be [\"TIMESTAMPS\"] or"),
                           ({"trace_file": "/tmp/trace.json"}, "trace_file must be \"\": the spans leave through"),
                           ({"log_frequency": "50"}, "log_frequency must be \"0\""),
                           ({"trace_mode": "triton"}, "trace_mode must be \"opentelemetry\"")]:
            response = httpx.post(setting, json=body, headers=admin)
            assert response.status_code == 400 and said in response.json()["error"], response.text
        response = httpx.post(setting, content=b"[1]", headers=admin)
        assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]
        response = httpx.get(f"{url}/v2/models/nothing/trace/setting", headers=user)
        assert response.status_code == 404 and "unknown model 'nothing'" in response.json()["error"]
        response = httpx.post(f"{url}/v2/models/nothing/trace/setting", json={"trace_rate": "2"}, headers=admin)
        assert response.status_code == 404
        assert httpx.get(setting, headers=user).json() == DEFAULTS  # nothing refused changed anything


def test_off_while_tracing_is_off_and_without_admin_keys(repository):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_MODEL_CONTROL="true") as (url, _):
        off = DEFAULTS | {"trace_level": ["OFF"]}
        assert httpx.get(f"{url}/v2/trace/setting").json() == off
        response = httpx.post(f"{url}/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"]})
        assert response.status_code == 400
        assert "tracing is off; OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER)" in response.json()["error"]
    with running_service(repository, ATTEND_GRPC_PORT=str(port)) as (url, _):
        response = httpx.post(f"{url}/v2/trace/setting", json={"trace_rate": "2"})
        assert response.status_code == 404
        assert response.json() == {"error": "changing the trace settings is off: set ATTEND_ADMIN_KEYS (or "
                                            "ATTEND_MODEL_CONTROL=true on a trusted network)"}
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        error = _error(lambda: client.update_trace_settings(settings={"trace_rate": "2"}))
        assert error.status() == "StatusCode.NOT_FOUND" and "changing the trace settings is off" in error.message()
        assert list(client.get_trace_settings().settings["trace_level"].value) == ["OFF"]


def test_a_count_is_one_for_every_worker(repository, receiver):
    """Set through one worker, trace_count 3 traces 3 requests in all: 24 on new connections, which reach both."""
    with running_service(repository, ATTEND_WORKERS="2", ATTEND_INTRA_OP_THREADS="1", ATTEND_MODEL_CONTROL="true",
                         OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        assert httpx.post(f"{url}/v2/trace/setting", json={"trace_count": "3"}).json()["trace_count"] == "3"
        time.sleep(1.0)  # the SIGHUP through the supervisor
        client = httpclient.InferenceServerClient(url.removeprefix("http://"), concurrency=1)
        traced = []
        for _ in range(24):
            client.close()  # a new connection each: both workers serve
            client = httpclient.InferenceServerClient(url.removeprefix("http://"))
            traced += _traced(receiver, client, httpclient, "additive", 1)
        assert sum(traced) == 3, traced
        assert {httpx.get(f"{url}/v2/trace/setting").json()["trace_count"] for _ in range(8)} == {"0"}
