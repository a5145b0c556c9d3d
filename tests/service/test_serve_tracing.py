"""Tracing under Ray Serve (service/serve.py): Serve's proxy hands the replica the caller's headers as they came,
so the replica's request span continues the caller's trace, and its traceresponse header comes back through the
proxy. A real local Ray and Serve proxy, one replica exporting to a receiver in this process (tests/otlp.py).
`make test-ray` (the ray extra); `make test` leaves it out."""

from __future__ import annotations

import json

import httpx
import pytest

from service.http.schemas import toy_request
from tests.otlp import Receiver
from tests.service.test_serve import on_serve
from tests.service.test_tracing import check_stages, server_span, traceparent

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def traced_serve(repository):
    """(proxy URL, receiver): one replica of the deployment, tracing to the receiver over gRPC."""
    with Receiver() as receiver:
        env = {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cpu", "ATTEND_LOG_LEVEL": "warning",
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_SERVICE_NAME": "attend-ray"}
        with on_serve(env, 1) as url:
            yield url, receiver


def test_the_replica_continues_the_callers_trace(traced_serve):
    url, receiver = traced_serve
    parent, trace_id, span_id = traceparent()
    response = httpx.post(f"{url}/attend", content=json.dumps(toy_request()), timeout=60,
                          headers={"content-type": "application/json", "traceparent": parent})
    assert response.status_code == 200, response.text
    assert response.headers["traceresponse"].split("-")[1] == trace_id
    request = server_span(receiver, trace_id, timeout=30)
    assert (request.name, request.parent) == ("POST /attend", span_id)
    assert request.resource["service.name"] == "attend-ray"
    check_stages(receiver, request, "json")
