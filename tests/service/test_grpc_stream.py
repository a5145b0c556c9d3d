"""ModelStreamInfer, Triton's stream of inference calls, against the real process (`python -m service` with
ATTEND_GRPC_PORT): tritonclient's stream, sync and aio, gives /attend's numbers, an error ends only its own
request (with Triton's triton_grpc_error, the stream with its status), the API key holds; the guard's bounds
hold per message (ATTEND_MAX_CONNECTIONS) and per stream (ATTEND_MAX_OPEN_CONNECTIONS); a client that sends
and does not read is held back; a cancelled stream's call counts as gone; SIGTERM answers what is under way,
then ends the stream UNAVAILABLE."""

import asyncio
import json
import signal
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from service.http.schemas import toy_request
from tests.server import free_port, running_service
from tests.service.test_grpc import BOOK_OUTPUTS, _attention, _grpc_count, _in_flight, _inputs, _slow_call, _stream
from tests.service.test_overload import rss_mb
from tests.service.test_v2 import _arrays, _bodies, _check, _expected

pytestmark = pytest.mark.slow

KEY = "stream-key"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    """(HTTP URL, gRPC address, process) of one service with an API key. Its log, at the end: no traceback."""
    port = free_port()
    log = tmp_path_factory.mktemp("stream") / "service.log"
    with running_service(repository, log_path=log, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_API_KEYS=KEY) as (url, proc):
        yield url, f"127.0.0.1:{port}", proc
    assert "Traceback" not in log.read_text() and "never retrieved" not in log.read_text()


def test_a_stream_gives_attends_numbers_and_an_error_ends_only_its_request(server):
    url, address, _ = server
    client = grpcclient.InferenceServerClient(address)
    answers = _stream(client, {"authorization": f"Bearer {KEY}"})
    bodies = _bodies()
    _, book = _arrays(json.dumps(toy_request()).encode())
    wrong = dict(book, keys=book["keys"][:, :, :1])  # additive's keys have 2 features
    for i, body in enumerate(bodies):  # every kind, valid lengths absent, 1-D and 2-D; all sent before one is read
        model, tensors = _arrays(body)
        client.async_stream_infer(model, _inputs(grpcclient, tensors), request_id=str(i))
        if i == 1:
            client.async_stream_infer("additive", _inputs(grpcclient, wrong), request_id="wrong")
            client.async_stream_infer("nope", _inputs(grpcclient, book), request_id="nope")
    client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="book")
    results, errors = {}, []
    for _ in range(len(bodies) + 3):
        result, error = answers.get(timeout=30)
        if error is None:
            results[result.get_response().id] = result
        else:
            errors.append(error.message())
    client.stop_stream()
    assert len(errors) == 2, errors
    assert any(e.startswith("input keys: keys must have 2 features (axis 2)") for e in errors), errors
    assert any(e.startswith("unknown model 'nope'; available: additive") for e in errors), errors
    assert set(results) == {str(i) for i in range(len(bodies))} | {"book"}
    for i, body in enumerate(bodies):
        _check(results[str(i)], _expected(url, body, {"authorization": f"Bearer {KEY}"}))
        response = results[str(i)].get_response()
        assert response.model_name == json.loads(body)["model"] and response.model_version == "1"
    np.testing.assert_allclose(results["book"].as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)
    # Counted as every gRPC call is, by model and status.
    metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert 'attend_requests_total{model="additive",protocol="grpc",status="422"} 1.0' in metrics
    assert 'attend_requests_total{model="-",protocol="grpc",status="404"} 1.0' in metrics
    assert 'attend_requests_total{model="additive",protocol="grpc",status="200"}' in metrics


def test_with_triton_grpc_error_the_first_error_ends_the_stream_with_its_status(server):
    """Triton's `triton_grpc_error: true` metadata: an error ends the stream with its gRPC status (the client sees
    INVALID_ARGUMENT naming the input), and a message still under way is cancelled (counted 499, never answered).
    tritonclient then refuses to send on the stream."""
    url, address, _ = server
    client = grpcclient.InferenceServerClient(address)
    answers = _stream(client, {"authorization": f"Bearer {KEY}", "triton_grpc_error": "true"})
    _, book = _arrays(json.dumps(toy_request()).encode())
    client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="book")
    result, error = answers.get(timeout=30)
    assert error is None and result.get_response().id == "book"
    np.testing.assert_allclose(result.as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)
    def cancelled_count():
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
        line = 'attend_requests_total{model="dot_product",protocol="grpc",status="499"} '
        return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))

    cancelled = cancelled_count()
    # A second or so on one core, at ATTEND_MAX_WEIGHT_ELEMENTS (2048 x 2048). It was (3, 2048, 64), over it:
    # refused once decoded, and on a busy machine that refusal (RESOURCE_EXHAUSTED) came before the wrong one's.
    slow = np.random.default_rng(4).normal(size=(1, 2048, 512)).astype(np.float32)
    client.async_stream_infer("dot_product", _inputs(grpcclient, {"queries": slow, "keys": slow, "values": slow}),
                              request_id="slow")
    client.async_stream_infer("additive", _inputs(grpcclient, dict(book, keys=book["keys"][:, :, :1])),
                              request_id="wrong")
    result, error = answers.get(timeout=30)
    assert result is None and error.status() == "StatusCode.INVALID_ARGUMENT", error.message()
    assert error.message().startswith("input keys: keys must have 2 features (axis 2) for model additive")
    with pytest.raises(InferenceServerException, match="no longer in valid state"):
        client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="after")
    deadline = time.monotonic() + 30
    while cancelled_count() == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled_count() == cancelled + 1
    assert answers.empty()  # the slow one never answered
    client.stop_stream()


def test_tritonclient_aio_stream_and_the_api_key(server):
    url, address, _ = server
    _, book = _arrays(json.dumps(toy_request()).encode())

    async def run(headers):
        client = aioclient.InferenceServerClient(address)

        async def requests():
            for i in range(4):
                yield {"model_name": "additive", "inputs": _inputs(aioclient, book), "request_id": str(i)}

        try:
            return [answer async for answer in client.stream_infer(requests(), headers=headers)]
        finally:
            await client.close()

    answers = asyncio.run(run({"authorization": f"Bearer {KEY}"}))
    assert sorted(result.get_response().id for result, error in answers if error is None) == ["0", "1", "2", "3"]
    for result, _ in answers:
        np.testing.assert_allclose(result.as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)
    for headers in (None, {"authorization": "Bearer wrong"}):  # each message refused, as a call would be
        answers = asyncio.run(run(headers))
        assert len(answers) == 4 and all(result is None for result, _ in answers)
        assert all("API key" in error.message() for _, error in answers), answers[0][1].message()


def test_a_client_that_sends_and_does_not_read_is_held_back(server):
    """20,000 messages, none read back: each answer (an error naming the model, with its 4 kB id) waits on
    the client, and past ATTEND_MAX_CONNECTIONS (512) calls waiting so, the service stops taking messages in.
    Its memory stays put, and it answers HTTP meanwhile. Read at last, every one is answered, and the stream
    ends OK. (Refusals written from tasks of their own took in all of them: 80 MB and growing.)"""
    url, address, proc = server
    message = pb.ModelInferRequest(model_name="nope", id="x" * 4096).SerializeToString()
    sent = [0]

    def messages():
        for _ in range(20_000):
            sent[0] += 1
            yield message

    before = rss_mb(proc.pid)
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM)(messages(), metadata=[("authorization", f"Bearer {KEY}")])
        time.sleep(2)
        held_at = sent[0]
        time.sleep(1)
        assert sent[0] == held_at < 20_000, f"the service took in {sent[0]} messages with no answer read"
        assert httpx.get(f"{url}/health/live", timeout=5).status_code == 200
        assert rss_mb(proc.pid) - before < 32
        answers = [pb.ModelStreamInferResponse.FromString(raw) for raw in call]
        assert call.code() == grpc.StatusCode.OK
    assert len(answers) == 20_000
    assert {a.error_message.partition(";")[0] for a in answers} <= {
        "unknown model 'nope'", "512 calls are under way (ATTEND_MAX_CONNECTIONS)"}


def test_a_message_that_costs_more_parsed_is_refused_on_the_stream_which_goes_on(server):
    """A stream's message is walked before it is parsed, as a call's (service.grpc.wire): 2 MiB of empty
    inputs is refused naming them, and the stream's next message is answered."""
    _, address, _ = server
    costly = pb.ModelInferRequest(model_name="additive").SerializeToString() + b"\x2a\x00" * (1 << 20)
    _, book = _arrays(json.dumps(toy_request()).encode())
    good = pb.ModelInferRequest(model_name="additive", id="after")
    for name, array in book.items():
        good.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=array.shape)
        good.raw_input_contents.append(array.tobytes())
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM)(iter([costly, good.SerializeToString()]),
                                             metadata=[("authorization", f"Bearer {KEY}")])
        answers = [pb.ModelStreamInferResponse.FromString(raw) for raw in call]
    assert answers[0].error_message.startswith("the message has over 4096 fields (at inputs)"), answers[0]
    assert not answers[1].error_message and answers[1].infer_response.id == "after", answers[1].error_message
    outputs = answers[1].infer_response.raw_output_contents[0]
    np.testing.assert_allclose(np.frombuffer(outputs, np.float32).reshape(np.shape(BOOK_OUTPUTS)), BOOK_OUTPUTS,
                               rtol=1e-6)


def test_the_bounds_hold_per_message_and_per_stream_and_a_cancelled_call_is_gone(repository, tmp_path):
    """ATTEND_MAX_CONNECTIONS=1: a stream's second message while its first runs is refused, on the stream,
    which goes on. ATTEND_MAX_OPEN_CONNECTIONS=1: a second stream is refused at once. A stream cancelled
    with a call under way: counted as gone (499)."""
    port = free_port()
    with running_service(repository, log_path=tmp_path / "service.log", ATTEND_GRPC_PORT=str(port),
                         ATTEND_INTRA_OP_THREADS="1", ATTEND_MAX_WEIGHT_ELEMENTS=str(64 << 20),
                         ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30), ATTEND_MAX_CONNECTIONS="1",
                         ATTEND_MAX_OPEN_CONNECTIONS="1") as (url, _):
        client, inputs, outputs, _, q = _slow_call(port)
        answers = _stream(client)
        client.async_stream_infer("dot_product", inputs, outputs=outputs, request_id="slow")
        _, book = _arrays(json.dumps(toy_request()).encode())
        client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="second")
        # A second stream while the first is open, on the client's connection (a second one is closed at once).
        with pytest.raises(grpc.RpcError) as error:
            next(pb_grpc.GRPCInferenceServiceStub(client._channel).ModelStreamInfer(iter([pb.ModelInferRequest()])))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "1 streams are open (ATTEND_MAX_OPEN_CONNECTIONS)" in error.value.details()
        first, second = answers.get(timeout=30), answers.get(timeout=30)
        assert first[0] is None and "1 calls are under way (ATTEND_MAX_CONNECTIONS)" in first[1].message()
        assert second[1] is None and second[0].get_response().id == "slow"
        np.testing.assert_allclose(second[0].as_numpy("outputs")[0, :2], _attention(q[0, :2], q[0], q[0]),
                                   rtol=1e-4, atol=1e-5)
        client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="after")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "after"
        # Cancelled with its call under way.
        client.async_stream_infer("dot_product", inputs, outputs=outputs, request_id="cancelled")
        waiting = time.monotonic() + 10
        while _in_flight(url) < 1 and time.monotonic() < waiting:
            time.sleep(0.01)
        assert _in_flight(url) == 1
        client.stop_stream(cancel_requests=True)
        waiting = time.monotonic() + 10
        while _grpc_count(url, 499) < 1 and time.monotonic() < waiting:
            time.sleep(0.05)
        assert _grpc_count(url, 499) == 1 and _in_flight(url) == 0
        # The stream's slot is free again.
        answers = _stream(client)
        client.async_stream_infer("additive", _inputs(grpcclient, book), request_id="again")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "again"
        client.stop_stream()
    assert "Traceback" not in (tmp_path / "service.log").read_text()


def test_sigterm_answers_the_streams_call_then_ends_the_stream(repository, tmp_path):
    port = free_port()
    with running_service(repository, log_path=tmp_path / "service.log", ATTEND_GRPC_PORT=str(port),
                         ATTEND_INTRA_OP_THREADS="1", ATTEND_MAX_WEIGHT_ELEMENTS=str(64 << 20),
                         ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30), ATTEND_GRACE_PERIOD_S="30") as (url, proc):
        client, inputs, outputs, _, q = _slow_call(port)
        answers = _stream(client)
        client.async_stream_infer("dot_product", inputs, outputs=outputs, request_id="slow")
        waiting = time.monotonic() + 10
        while _in_flight(url) < 1 and time.monotonic() < waiting:
            time.sleep(0.01)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "slow"
        np.testing.assert_allclose(result.as_numpy("outputs")[0, :2], _attention(q[0, :2], q[0], q[0]),
                                   rtol=1e-4, atol=1e-5)
        result, error = answers.get(timeout=30)  # the stream ends: open it again on another
        assert result is None and "the service is stopping" in error.message()
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 15, "the open stream held the stop until the grace period"
        client.stop_stream()
    assert "Traceback" not in (tmp_path / "service.log").read_text()
