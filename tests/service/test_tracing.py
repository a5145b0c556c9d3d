"""OpenTelemetry traces (service/core/tracing.py), against a real OTLP receiver (tests/otlp.py, built on
opentelemetry-proto's service definitions) and the SDK's own exporters, over gRPC and HTTP: the spans of
/attend, /v2 (JSON and binary) and gRPC's ModelInfer, their names, parents and attributes, the caller's
trace continued, the batch run linked to the requests it merged, refusals, the ids in the access log, the
OTEL_* values that stop the start, and a receiver that is down, slow or refusing, which costs no request
anything (its spans counted as dropped)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.core import logs
from service.core.tracing import TracingError, read_environment
from service.http.schemas import toy_request
from tests.otlp import Receiver, Span
from tests.server import ROOT, free_port, running_service
from tests.service.test_batching import make_body
from tests.service.test_observability import parse, value
from tests.service.test_overload import connect
from tests.service.test_v2 import K, Q, V, _binary, _toy
from tests.service.test_workers import worker_pids

pytestmark = pytest.mark.slow

KEY = "trace-key"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json", **AUTH}
TOY = json.dumps(toy_request()).encode()
STAGES = {"read body", "decode", "queue", "infer", "encode", "write"}


def traceparent() -> tuple[str, str, str]:
    """A caller's sampled context: (traceparent, its trace id, its span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def broken_repository(repository, tmp_path_factory):
    """The repository with positional_encoding's graph damaged: served without it (503 for its requests)."""
    path = tmp_path_factory.mktemp("traced") / "model_repository"
    shutil.copytree(repository, path)
    graph = path / "positional_encoding" / "1" / "model.onnx"
    graph.write_bytes(graph.read_bytes() + b"\0")
    return path


@pytest.fixture(scope="module")
def traced(broken_repository, receiver, tmp_path_factory):
    """(HTTP URL, gRPC address, log path) of a service tracing every request to the receiver over gRPC: API
    keys on, bodies up to 256 KiB (a gRPC message over 64 KiB has its raw contents lifted out), a batch that
    waits up to 20 ms for the requests of busy clients."""
    port = free_port()
    log = tmp_path_factory.mktemp("traced") / "service.log"
    with running_service(broken_repository, log_path=log, ready_path="/health/live", ATTEND_GRPC_PORT=str(port),
                         ATTEND_LOG_LEVEL="info", ATTEND_API_KEYS=KEY, ATTEND_MAX_BODY_BYTES=str(256 * 1024),
                         ATTEND_MAX_BATCH_WAIT_US="20000", ATTEND_SKIP_BROKEN_MODELS="true",
                         OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="50",
                         OTEL_SERVICE_NAME="attend-test", OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test"
                         ) as (url, _):
        yield url, f"127.0.0.1:{port}", log


def server_span(receiver: Receiver, trace_id: str, timeout: float = 15) -> Span:
    return receiver.wait(lambda spans: next((s for s in spans if s.trace_id == trace_id and s.kind == "SERVER"),
                                            None), timeout)


def children(receiver: Receiver, span: Span) -> dict[str, Span]:
    return {s.name: s for s in receiver.trace(span.trace_id) if s.parent == span.span_id}


def batch_of(receiver: Receiver, infer: Span) -> Span:
    (trace_id, span_id), = infer.links
    return receiver.wait(lambda spans: next((s for s in spans if s.span_id == span_id and s.trace_id == trace_id),
                                            None))


def check_stages(receiver: Receiver, request: Span, form: str) -> dict[str, Span]:
    """The request's stages as its children, within its time; encode within infer; the batch run linked both ways."""
    stages = children(receiver, request)
    assert set(stages) == STAGES - {"encode"}, sorted(stages)
    for stage in stages.values():
        assert stage.kind == "INTERNAL" and stage.status == "UNSET"
        assert request.start_ns - 1_000_000 <= stage.start_ns <= stage.end_ns <= request.end_ns + 1_000_000
    assert stages["read body"].attributes["attend.body.form"] == form
    assert stages["read body"].attributes["attend.body.bytes"] > 0
    assert stages["decode"].attributes["attend.decode.where"] == "inline"
    encode, = children(receiver, stages["infer"]).values()
    assert encode.name == "encode"
    batch = batch_of(receiver, stages["infer"])
    assert batch.name == "batch run" and batch.parent == "" and batch.trace_id != request.trace_id
    assert (request.trace_id, request.span_id) in batch.links
    run, = children(receiver, batch).values()
    assert run.name == "session run" and batch.start_ns <= run.start_ns <= run.end_ns <= batch.end_ns
    return stages


# ------------------------------------------------------------------------------------------------ the switches


def test_tracing_is_off_unless_opentelemetrys_variables_configure_it():
    assert read_environment({}) is None
    assert read_environment({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None
    on = read_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert on is not None and on.exporters == ("otlp",) and on.protocol == "grpc"
    on = read_environment({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://tempo:4318/v1/traces",
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_SAMPLER": "traceidratio",
                           "OTEL_TRACES_SAMPLER_ARG": "0.01"})
    assert on is not None and on.protocol == "http/protobuf" and on.ratio == 0.01
    assert read_environment({"OTEL_TRACES_EXPORTER": "console"}).exporters == ("console",)
    assert read_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}) is None
    assert read_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}) is None


BAD_VALUES = [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT='collector:4317' is not a URL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:43x7"}, "its port is not a number"),
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "speak grpc or http/protobuf"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
     "OTEL_TRACES_SAMPLER_ARG='1.5': a ratio from 0 to 1"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "ten"}, "OTEL_TRACES_SAMPLER_ARG='ten'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_RESOURCE_ATTRIBUTES": "team=a,oops"}, "'oops' is not key=value"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BSP_MAX_QUEUE_SIZE='lots'"),
]


@pytest.mark.parametrize(("environ", "message"), BAD_VALUES, ids=[m.split("=")[0] for _, m in BAD_VALUES])
def test_a_bad_otel_value_is_one_line_at_start(environ, message):
    with pytest.raises(TracingError, match=message.replace("(", r"\(")):
        read_environment(environ)


def test_the_service_does_not_start_on_a_bad_otel_value(tmp_path):
    """`python -m service` says why in one line and exits 1, before it loads a model."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(ATTEND_MODEL_REPOSITORY=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4317",
               OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="2")
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == ("cannot start: OTEL_TRACES_SAMPLER_ARG='2': a ratio from 0 to 1 for "
                                   "traceidratio"), done.stderr


def test_error_logs_carry_the_ids_while_a_request_is_traced():
    formatter, record = logs._Formatter(), logging.LogRecord("service", logging.ERROR, "", 0, "boom", (), None)
    token = logs.trace_ids.set("trace_id=0af7651916cd43dd8448eb211c80319c span_id=b7ad6b7169203331")
    try:
        logs.RequestIdFilter().filter(record)
    finally:
        logs.trace_ids.reset(token)
    assert formatter.format(record).endswith(
        "ERROR service [-] boom trace_id=0af7651916cd43dd8448eb211c80319c span_id=b7ad6b7169203331")


# ------------------------------------------------------------------------------------------- the spans


def test_attend_continues_the_callers_trace(traced, receiver):
    url, _, log = traced
    parent, trace_id, span_id = traceparent()
    response = httpx.post(f"{url}/attend", content=TOY, headers={**JSON, "traceparent": parent,
                                                                 "tracestate": "vendor=opaque"})
    assert response.status_code == 200
    version, got_trace, got_span, flags = response.headers["traceresponse"].split("-")
    assert (version, got_trace, flags) == ("00", trace_id, "01")
    request = server_span(receiver, trace_id)
    assert (request.name, request.parent, request.span_id, request.trace_state) == (
        "POST /attend", span_id, got_span, "vendor=opaque")
    a = request.attributes
    assert (a["http.request.method"], a["http.route"], a["url.path"], a["http.response.status_code"]) == (
        "POST", "/attend", "/attend", 200)
    assert a["url.scheme"] == "http" and a["client.address"] == "127.0.0.1"
    assert a["server.port"] == int(url.rsplit(":", 1)[1]) and a["user_agent.original"].startswith("python-httpx")
    assert request.status == "UNSET" and "error.type" not in a
    assert request.resource["service.name"] == "attend-test"
    assert request.resource["deployment.environment"] == "test"
    assert request.resource["telemetry.sdk.name"] == "opentelemetry"
    stages = check_stages(receiver, request, "json")
    batch = batch_of(receiver, stages["infer"])
    b = batch.attributes
    assert (b["attend.model.name"], b["attend.model.version"], b["attend.execution_provider"]) == (
        "additive", 1, "CPUExecutionProvider")
    assert b["attend.batch.size"] == 2 and b["attend.batch.requests"] >= 1 and b["attend.batch.padded_elements"] >= 0
    assert b["attend.graph"].startswith("1/") and b["attend.graph"].endswith(".onnx")
    assert stages["infer"].attributes["attend.request.rows"] == 2
    # The access line leads to the trace.
    deadline = time.monotonic() + 5
    while f"trace_id={trace_id} span_id={got_span}" not in log.read_text():
        assert time.monotonic() < deadline, "no access line with the request's ids"
        time.sleep(0.1)
    line, = [line for line in log.read_text().splitlines() if trace_id in line]
    assert " service.access " in line and "POST /attend 200" in line


def test_a_request_without_a_traceparent_starts_a_trace(traced, receiver):
    url, _, _ = traced
    response = httpx.post(f"{url}/attend", content=TOY, headers=JSON)
    _, trace_id, span_id, flags = response.headers["traceresponse"].split("-")
    assert flags == "01" and len(trace_id) == 32
    request = server_span(receiver, trace_id)
    assert request.parent == "" and request.span_id == span_id


def test_v2_json_and_binary(traced, receiver):
    url, _, _ = traced
    json_body = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(a.shape),
                                        "data": a.ravel().tolist()} for name, a in (("queries", Q), ("keys", K),
                                                                                    ("values", V))]})
    binary_body, binary_headers = _binary(_toy())
    for path, body, headers, form, route in (
            ("/v2/models/additive/infer", json_body, {}, "json", "/v2/models/{model_name}/infer"),
            ("/v2/models/additive/versions/1/infer", binary_body, binary_headers, "binary",
             "/v2/models/{model_name}/versions/{model_version}/infer")):
        parent, trace_id, _ = traceparent()
        response = httpx.post(f"{url}{path}", content=body, headers={**JSON, **headers, "traceparent": parent})
        assert response.status_code == 200, response.text
        request = server_span(receiver, trace_id)
        assert request.name == f"POST {route}" and request.attributes["http.route"] == route
        assert request.attributes["url.path"] == path
        check_stages(receiver, request, form)


def _grpc_request(batch: int = 1) -> pb.ModelInferRequest:
    """The toy request, `batch` times over (over 64 KiB, the guard lifts its raw contents out of the message)."""
    request = pb.ModelInferRequest(model_name="additive")
    for name, array in (("queries", Q), ("keys", K), ("values", V)):
        array = np.concatenate([array] * batch)
        request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


def test_grpc_model_infer(traced, receiver):
    _, address, _ = traced
    parent, trace_id, span_id = traceparent()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelInfer.with_call(_grpc_request(), metadata=(("traceparent", parent),
                                                                       ("authorization", f"Bearer {KEY}")))
    trailing = dict(call.trailing_metadata())
    assert trailing["traceresponse"].split("-")[1] == trace_id
    request = server_span(receiver, trace_id)
    assert (request.name, request.parent) == ("inference.GRPCInferenceService/ModelInfer", span_id)
    a = request.attributes
    assert (a["rpc.system.name"], a["rpc.method"], a["rpc.response.status_code"]) == (
        "grpc", "inference.GRPCInferenceService/ModelInfer", "OK")
    assert a["client.address"] == "127.0.0.1" and a["client.port"] > 0
    assert request.status == "UNSET"
    check_stages(receiver, request, "grpc raw")


def test_grpc_model_stream_infer(traced, receiver):
    """Each message of a stream is a request span, a child of the stream's traceparent; a large one's raw contents
    (lifted out of the message) are its form."""
    _, address, _ = traced
    parent, trace_id, span_id = traceparent()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([_grpc_request(batch=256)]), metadata=(
            ("traceparent", parent), ("authorization", f"Bearer {KEY}"))))
    assert [a.error_message for a in answers] == [""]
    request = server_span(receiver, trace_id)
    assert (request.name, request.parent) == ("inference.GRPCInferenceService/ModelStreamInfer", span_id)
    a = request.attributes
    assert (a["rpc.method"], a["rpc.response.status_code"]) == (
        "inference.GRPCInferenceService/ModelStreamInfer", "OK")
    check_stages(receiver, request, "grpc raw")


def test_a_merged_batch_is_one_span_linked_to_each_request(traced, receiver):
    """Four clients at a barrier, one model, different n_k: a run that merged several of them is one span,
    linked to each request's span; each request's share (infer) links back to it."""
    url, _, _ = traced
    rng = np.random.default_rng(3)
    bodies = [make_body("masked_softmax", rng, 1, 2, n_k, "2d") for n_k in (3, 4, 5, 6)]
    barrier = threading.Barrier(len(bodies))

    def send(body: bytes) -> str:
        parent, trace_id, _ = traceparent()
        with httpx.Client(base_url=url, headers=JSON) as client:
            client.get("/health/live")  # connected before the barrier
            barrier.wait()
            assert client.post("/attend", content=body, headers={"traceparent": parent}).status_code == 200
        return trace_id

    with ThreadPoolExecutor(len(bodies)) as pool:
        for _ in range(20):
            barrier.reset()
            sent = list(pool.map(send, bodies))
            requests = {t: server_span(receiver, t) for t in sent}
            infers = {t: children(receiver, r)["infer"] for t, r in requests.items()}
            merged = [i for i in infers.values() if i.attributes["attend.batch.requests"] > 1]
            if merged:
                break
    assert merged, "no run merged two of the requests in 20 tries"
    batch = batch_of(receiver, merged[0])
    served = [t for t, i in infers.items() if i.links == [(batch.trace_id, batch.span_id)]]
    assert len(served) == batch.attributes["attend.batch.requests"] >= 2
    assert sorted(batch.links) == sorted((t, requests[t].span_id) for t in served)
    assert batch.attributes["attend.batch.size"] == len(served)  # one row each
    assert batch.attributes["attend.batch.padded_elements"] > 0  # n_k differ: the shorter ones were padded
    for t in served:
        share = infers[t]
        assert (share.start_ns, share.end_ns) == (batch.start_ns, batch.end_ns)
        assert share.attributes["attend.batch.requests"] == len(served)


# ------------------------------------------------------------------------------------------------ refusals


def _refusal(receiver: Receiver, trace_id: str, status: int | None, code: str, error: bool) -> Span:
    request = server_span(receiver, trace_id)
    assert request.attributes.get("http.response.status_code") == status
    assert request.attributes["error.type"] == code and request.attributes["attend.error.message"]
    assert request.status == ("ERROR" if error else "UNSET")
    return request


def test_refusals_end_their_span_with_the_errors_code(traced, receiver):
    url, _, _ = traced
    cases = [  # (headers, body, path, status, error.type, span status ERROR: a 5xx, or no answer)
        ({"content-type": "application/json"}, TOY, "/attend", 401, "unauthorized", False),
        (JSON, b"[" + b"0," * 140_000 + b"0]", "/attend", 413, "payload_too_large", False),
        (JSON, json.dumps({"model": "positional_encoding", "queries": [[[0.0, 1.0]]]}).encode(), "/attend", 503,
         "model_unavailable", True),
        ({**JSON, "x-request-timeout-ms": "0.001"}, TOY, "/attend", 504, "deadline_exceeded", True),
    ]
    for headers, body, path, status, code, error in cases:
        parent, trace_id, _ = traceparent()
        response = httpx.post(f"{url}{path}", content=body, headers={**headers, "traceparent": parent})
        assert response.status_code == status, response.text
        assert response.headers["traceresponse"].split("-")[1] == trace_id
        request = _refusal(receiver, trace_id, status, code, error)
        if status == 401:
            assert children(receiver, request) == {}  # refused before anything was read
        if status == 413:
            read = children(receiver, request)["read body"]
            assert read.status == "ERROR" and read.message == "payload_too_large"


def test_a_client_gone_ends_its_span_unanswered(traced, receiver):
    """499: the client closed the connection in the middle of its body; nothing was answered."""
    url, _, _ = traced
    parent, trace_id, _ = traceparent()
    sock = connect(url)
    sock.sendall(("POST /attend HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"authorization: Bearer {KEY}\r\ntraceparent: {parent}\r\ncontent-length: 5000\r\n\r\n").encode()
                 + TOY[:100])
    time.sleep(0.2)
    sock.close()
    request = _refusal(receiver, trace_id, None, "client_closed_request", True)
    assert children(receiver, request)["read body"].status == "ERROR"


def test_grpc_refusals(traced, receiver):
    _, address, _ = traced
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for metadata, code, name, error in (
                ((), grpc.StatusCode.UNAUTHENTICATED, "unauthorized", False),
                ((("authorization", f"Bearer {KEY}"), ("x-request-timeout-ms", "0.001")),
                 grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", True)):
            parent, trace_id, _ = traceparent()
            with pytest.raises(grpc.RpcError) as raised:
                stub.ModelInfer(_grpc_request(), metadata=(("traceparent", parent), *metadata))
            assert raised.value.code() == code
            assert dict(raised.value.trailing_metadata())["traceresponse"].split("-")[1] == trace_id
            request = server_span(receiver, trace_id)
            assert request.attributes["rpc.response.status_code"] == code.name
            assert request.attributes["error.type"] == name
            assert request.status == ("ERROR" if error else "UNSET")


# ------------------------------------------------------------------------- the exporter over HTTP, sampling


def test_http_protobuf_and_a_sample_ratio(repository, receiver):
    """OTLP over HTTP (gzip), a ratio of 0 for new traces: a request of its own is not sampled (its ids still go
    out, flags 00), a caller's sampled trace is continued (parent-based)."""
    with running_service(repository, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                         OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.http_endpoint}/v1/traces",
                         OTEL_EXPORTER_OTLP_COMPRESSION="gzip", OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                         OTEL_TRACES_SAMPLER_ARG="0", OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        response = httpx.post(f"{url}/attend", content=TOY, headers=JSON)
        _, unsampled, _, flags = response.headers["traceresponse"].split("-")
        assert flags == "00"
        parent, trace_id, _ = traceparent()
        assert httpx.post(f"{url}/attend", content=TOY, headers={**JSON, "traceparent": parent}).status_code == 200
        request = server_span(receiver, trace_id)
        assert request.via == "http" and request.resource["service.name"] == "attend"
        check_stages(receiver, request, "json")
        time.sleep(0.5)
        assert receiver.trace(unsampled) == []


# ------------------------------------------------------------------ a receiver down, slow or refusing


def _metric(url: str, name: str, **labels: str) -> float:
    return value(parse(httpx.get(f"{url}/metrics", timeout=10).text), name, **labels)


def _answered_at_once(url: str, count: int) -> float:
    """`count` requests, each answered 200: the slowest one's seconds."""
    slowest = 0.0
    with httpx.Client(base_url=url, headers=JSON, timeout=10) as client:
        for _ in range(count):
            start = time.monotonic()
            assert client.post("/attend", content=TOY).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
    return slowest


def _until(check, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "not within the time"
        time.sleep(0.2)


def test_a_receiver_that_is_down_costs_no_request_anything(repository, tmp_path):
    """Nothing listens at the endpoint: every request answered as fast as ever, the spans counted as dropped
    (export_failed), and the stop not held by the spans still queued."""
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
                         OTEL_EXPORTER_OTLP_TIMEOUT="1", OTEL_BSP_SCHEDULE_DELAY="50") as (url, proc):
        assert _answered_at_once(url, 40) < 0.5
        _until(lambda: _metric(url, "attend_trace_spans_dropped_total", reason="export_failed") > 0)
        assert _metric(url, "attend_trace_spans_exported_total") == 0
        assert _answered_at_once(url, 40) < 0.5  # queued spans to export, the receiver still down
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert time.monotonic() - start < 10
    assert "Traceback" not in log.read_text()


def test_a_slow_receiver_costs_no_request_anything(repository):
    """Each export takes 2 s: the exporter's queue (16 spans) fills, spans are dropped and counted (queue_full);
    requests are answered as fast as ever."""
    with Receiver(delay=2.0) as slow, running_service(
            repository, OTEL_EXPORTER_OTLP_ENDPOINT=slow.grpc_endpoint, OTEL_BSP_MAX_QUEUE_SIZE="16",
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE="8", OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        assert _answered_at_once(url, 40) < 0.5
        assert _metric(url, "attend_trace_spans_dropped_total", reason="queue_full") > 0
        _until(lambda: _metric(url, "attend_trace_spans_exported_total") > 0)  # what it took came in
        assert slow.spans


def test_a_refusing_receiver_costs_no_request_anything(repository):
    """The receiver answers PERMISSION_DENIED (not retried): the spans dropped and counted."""
    with Receiver(refuse=True) as refusing, running_service(
            repository, OTEL_EXPORTER_OTLP_ENDPOINT=refusing.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        assert _answered_at_once(url, 20) < 0.5
        _until(lambda: _metric(url, "attend_trace_spans_dropped_total", reason="export_failed") >= 20 * 7)
        assert _metric(url, "attend_trace_spans_exported_total") == 0
        assert refusing.requests > 0 and not refusing.spans


def test_each_worker_traces(repository, receiver):
    """ATTEND_WORKERS=2: every worker process sets tracing up on its own; the spans it exports are summed over
    the workers in /metrics."""
    with running_service(repository, ATTEND_WORKERS="2", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
                         OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        # Both workers up: a worker still warming up accepts no connection (on a busy machine, for seconds).
        _until(lambda: len(worker_pids(url)) == 2 and _metric(url, "attend_ready") == 1, timeout=120)
        sent, pids = [], set()
        while len(pids) < 2 and len(sent) < 60:  # the kernel gives each new connection to either worker
            for _ in range(12):
                parent, trace_id, _ = traceparent()
                with httpx.Client(base_url=url, headers=JSON) as client:
                    assert client.post("/attend", content=TOY, headers={"traceparent": parent}).status_code == 200
                sent.append(trace_id)
            pids = {server_span(receiver, t).resource["process.pid"] for t in sent}
        assert len(pids) == 2, "one worker served them all"
        _until(lambda: _metric(url, "attend_trace_spans_exported_total") >= len(sent) * 7)
