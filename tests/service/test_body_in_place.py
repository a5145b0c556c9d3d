"""A large request body written into one buffer as it arrives (service.http.transport.BodySink, offered to
the endpoints as the "attend.body" extension) instead of uvicorn's bytearray, its bytes objects and
a join; the binary tensors of an Open Inference Protocol request read in place, and a binary
response sent in parts without joining them. Real uvicorn with the service's protocol, real sockets."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import subprocess
import time

import httpx
import numpy as np
import orjson
import pytest

from service.http.protocol import GuardedProtocol
from service.http.transport import BodySink
from service.protocols.v2 import InferCodec
from tests.server import running_service, uvicorn_in_thread
from tests.service.test_overload import read_response

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ the sink, under a probing app


async def probe(scope, receive, send):
    """Says how its body came: through "attend.body" (its type, where the aligned byte sits) or
    through receive(), with the body's length and digest."""
    if scope["type"] != "http":
        return
    claim = scope["extensions"].get("attend.body")
    aligned_at = int(dict(scope["headers"]).get(b"x-aligned-at", b"0"))
    if claim is not None:
        body = await claim(aligned_at)
        if body is None:
            PROBED.append("gone")
            return
        address = np.frombuffer(body, dtype=np.uint8).ctypes.data
        how = {"via": "claim", "type": type(body).__name__, "aligned": (address + aligned_at) % 64 == 0}
    else:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        how = {"via": "receive"}
    answer = orjson.dumps(how | {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


PROBED: list[str] = []


@pytest.fixture(scope="module")
def probe_server():
    with uvicorn_in_thread(probe, GuardedProtocol) as port:
        yield port


def _head(length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST /x HTTP/1.1\r\nHost: t\r\n{size}{extra}\r\n".encode()


BODY = np.random.default_rng(1).integers(0, 256, size=3 * 256 * 1024 + 123, dtype=np.uint8).tobytes()
DIGEST = hashlib.sha256(BODY).hexdigest()


@pytest.mark.parametrize("aligned_at", [0, 1, 475, 4099])
def test_a_body_sent_in_slow_pieces_arrives_whole_and_aligned(probe_server, aligned_at):
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        sock.sendall(_head(len(BODY), f"X-Aligned-At: {aligned_at}\r\n"))
        for start in range(0, len(BODY), 100_000):  # the app claims the body before most of it is here
            sock.sendall(BODY[start:start + 100_000])
            time.sleep(0.01)
        status, _, answer = read_response(sock)
    assert status == 200
    assert json.loads(answer) == {"via": "claim", "type": "memoryview", "aligned": True, "length": len(BODY),
                                  "sha256": DIGEST}


def test_a_body_already_complete_when_claimed(probe_server):
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        sock.sendall(_head(1000, "X-Aligned-At: 7\r\n") + BODY[:1000])
        status, _, answer = read_response(sock)
    assert status == 200
    assert json.loads(answer) == {"via": "claim", "type": "memoryview", "aligned": True, "length": 1000,
                                  "sha256": hashlib.sha256(BODY[:1000]).hexdigest()}


def test_expect_100_continue_is_answered_before_the_body(probe_server):
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        sock.settimeout(5)
        sock.sendall(_head(len(BODY), "Expect: 100-continue\r\n"))
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"  # nothing of the body sent yet
        sock.sendall(BODY)
        status, _, answer = read_response(sock)
    assert status == 200 and json.loads(answer)["sha256"] == DIGEST


def test_a_chunked_body_goes_through_receive(probe_server):
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(BODY[i:i + 65536]), BODY[i:i + 65536])
                          for i in range(0, len(BODY), 65536))
        sock.sendall(_head(None) + chunks + b"0\r\n\r\n")
        status, _, answer = read_response(sock)
    assert status == 200
    assert json.loads(answer) == {"via": "receive", "length": len(BODY), "sha256": DIGEST}


@pytest.mark.parametrize("split", [3000, 300_000])
def test_pipelined_requests_each_get_their_own_body(probe_server, split):
    # Large ones too: the guard once took the rest of a pipelined request's body, after the first
    # response, for headers (and refused it with a 431 past ATTEND_MAX_HEADER_BYTES).
    first, second = BODY[:split], BODY[split:]
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        sock.sendall(_head(len(first)) + first + _head(len(second)) + second)
        sock.settimeout(10)
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            data += sock.recv(65536)
        answers = [(int(part.split(b" ", 1)[0]), None, part.split(b"\r\n\r\n", 1)[1])
                   for part in data.split(b"HTTP/1.1 ")[1:]]
    assert [a[0] for a in answers] == [200, 200]
    assert [json.loads(a[2])["sha256"] for a in answers] == [hashlib.sha256(b).hexdigest() for b in (first, second)]


def test_a_client_gone_mid_body_resolves_the_claim_to_none(probe_server):
    PROBED.clear()
    with socket.create_connection(("127.0.0.1", probe_server)) as sock:
        sock.sendall(_head(len(BODY)) + BODY[:200_000])
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while PROBED != ["gone"]:
        assert time.monotonic() < deadline, PROBED
        time.sleep(0.02)


@pytest.mark.parametrize("aligned_at", range(0, 130, 13))
def test_the_sink_places_the_aligned_byte(aligned_at):
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        sink = BodySink(1000, aligned_at, loop.create_future())
        sink.write(b"a" * 600)
        sink.write(memoryview(b"b" * 400))
        sink.finish()
        body = sink.done.result()
    finally:
        loop.close()
    assert bytes(body) == b"a" * 600 + b"b" * 400
    assert (np.frombuffer(body, dtype=np.uint8).ctypes.data + aligned_at) % 64 == 0


def test_binary_tensors_of_an_aligned_body_are_read_in_place(repository):
    """What the alignment is for: the inputs ONNX Runtime gets are views of the body, not copies."""
    from service.core.request import RequestLimits
    from service.core.runtime import Registry

    x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    inputs = [{"name": n, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
              for n in ("queries", "keys", "values")]
    head = json.dumps({"inputs": inputs}).encode()
    raw = head + x.tobytes() * 3
    codec = InferCodec()
    model = Registry.load(repository, "cpu", 1).get("dot_product")
    headers = {b"inference-header-content-length": str(len(head)).encode()}
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        sink = BodySink(len(raw), len(head), loop.create_future())
        sink.write(raw)
        sink.finish()
        body = sink.done.result()
    finally:
        loop.close()
    request, _ = codec.decode_for(model, headers, body, RequestLimits())
    for name in ("queries", "keys", "values"):
        assert np.shares_memory(request.feed[name], np.frombuffer(body, dtype=np.uint8)), name
        np.testing.assert_array_equal(request.feed[name], x)
    # bytes, the header's odd length: copied, same values
    unaligned, _ = codec.decode_for(model, headers, raw, RequestLimits())
    for name in ("queries", "keys", "values"):
        np.testing.assert_array_equal(unaligned.feed[name], x)


# ------------------------------------------------------------- the service, over real HTTP


def _binary(x: np.ndarray) -> tuple[bytes, int]:
    inputs = [{"name": n, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
              for n in ("queries", "keys", "values")]
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + x.tobytes() * 3, len(head)


def _outputs(answer: bytes, header_length: int) -> dict[str, np.ndarray]:
    head = json.loads(answer[:header_length])
    out, offset = {}, header_length
    for entry in head["outputs"]:
        size = entry["parameters"]["binary_data_size"]
        out[entry["name"]] = np.frombuffer(answer[offset:offset + size], dtype="<f4").reshape(entry["shape"])
        offset += size
    assert offset == len(answer)
    return out


@pytest.fixture(scope="module")
def service(repository):
    with running_service(repository) as (url, proc):
        yield url, proc


X = np.random.default_rng(2).normal(size=(4, 128, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def expected(service):
    url, _ = service
    answer = httpx.post(f"{url}/attend", json={"model": "dot_product", "queries": X.tolist(), "keys": X.tolist(),
                                               "values": X.tolist()}, timeout=30).json()
    return {"outputs": np.array(answer["outputs"], dtype=np.float32),
            "attention_weights": np.array(answer["attention_weights"], dtype=np.float32)}


def _raw_infer(url: str, pieces: int, pause: float, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    body, header_length = _binary(X)
    port = int(url.rsplit(":", 1)[1])
    head = (f"POST /v2/models/dot_product/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {header_length}\r\n{extra}\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(head)
        step = -(-len(body) // pieces)
        try:
            for start in range(0, len(body), step):
                sock.sendall(body[start:start + step])
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and the connection closed) before the body was all sent: read why
        return read_response(sock)


def test_binary_request_in_slow_pieces_gives_attends_numbers(service, expected):
    status, headers, answer = _raw_infer(service[0], pieces=7, pause=0.02)
    assert status == 200
    outputs = _outputs(answer, int(headers["inference-header-content-length"]))
    for name in ("outputs", "attention_weights"):
        np.testing.assert_allclose(outputs[name], expected[name], rtol=1e-5, atol=1e-6)


def test_the_deadline_passes_while_the_body_is_coming(service):
    status, _, answer = _raw_infer(service[0], pieces=4, pause=0.25, extra="X-Request-Timeout-Ms: 300\r\n")
    assert status == 504
    assert "deadline" in json.loads(answer)["error"]
    assert httpx.get(f"{service[0]}/health/ready").status_code == 200


def test_a_client_gone_mid_body_is_counted_and_the_service_goes_on(service, expected):
    url, _ = service
    body, header_length = _binary(X)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall((f"POST /v2/models/dot_product/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
                      f"Inference-Header-Content-Length: {header_length}\r\n\r\n").encode() + body[:len(body) // 3])
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while 'attend_client_gone_total{model="dot_product"}' not in (metrics := httpx.get(f"{url}/metrics").text):
        assert time.monotonic() < deadline, "the request whose client went away mid-body was never counted"
        time.sleep(0.05)
    assert 'attend_requests_total{model="dot_product",protocol="http",status="499"}' in metrics
    status, headers, answer = _raw_infer(url, pieces=1, pause=0)
    assert status == 200


def test_a_binary_response_goes_out_in_one_writev_unjoined(service, expected, tmp_path, strace):
    """The head, the JSON header and each output's bytes leave in one writev(), as separate buffers
    (nothing joined), and the client reads the right numbers."""
    url, proc = service
    body, header_length = _binary(X)
    headers = {"Inference-Header-Content-Length": str(header_length), "Content-Type": "application/octet-stream"}
    trace = tmp_path / "writes.txt"
    with httpx.Client(base_url=url, timeout=30) as http, contextlib.ExitStack() as stack:
        assert http.post("/v2/models/dot_product/infer", content=body, headers=headers).status_code == 200
        strace = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=write,writev,sendto,sendmsg", "-s", "64",
                                   "-o", str(trace), "-p", str(proc.pid)], stderr=subprocess.PIPE)
        stack.callback(strace.wait, timeout=10)
        stack.callback(strace.terminate)
        deadline = time.monotonic() + 10
        while not trace.exists() or strace.poll() is not None:
            if strace.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"strace could not attach: {strace.stderr.read().decode()[-300:]}")
            time.sleep(0.05)
        time.sleep(0.5)
        answer = http.post("/v2/models/dot_product/infer", content=body, headers=headers)
        time.sleep(0.3)
    outputs = _outputs(answer.content, int(answer.headers["inference-header-content-length"]))
    np.testing.assert_allclose(outputs["outputs"], expected["outputs"], rtol=1e-5, atol=1e-6)
    lines = [line for line in trace.read_text().splitlines() if '"HTTP/1.1 200' in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "writev(" in line, line
    assert line.count("iov_base=") == 4, line  # the head, the JSON header, outputs, attention_weights
    sent = int(line.rsplit("= ", 1)[1])
    assert 0 < sent <= len(answer.content) + 300  # what the kernel took at once; the rest follows when it can
