"""A response's head and body (or its parts) held and written at once by the service's protocol ("attend.hold",
service.http.transport.CoalescingTransport): the same bytes on the wire as uvicorn's own writes, the connection
kept alive, closed or pipelined the same way. Real uvicorn with the service's protocol, real sockets; then the
real service process."""

from __future__ import annotations

import json
import re
import socket

import numpy as np
import pytest

from service.http.extensions import send_body
from service.http.protocol import GuardedProtocol
from service.http.schemas import toy_request
from tests.server import running_service, uvicorn_in_thread

pytestmark = pytest.mark.slow

BIG = np.arange(40_000, dtype=np.float32).tobytes()  # past 64 KiB: written unjoined


async def app(scope, receive, send):
    """Answers through send_body, held (path /fast...) or each message its own write (/slow...);
    /...parts sends a body in three parts, /...big one of 160 KB."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    extensions = scope["extensions"]
    path = scope["path"]
    body: bytes | list = b'{"a":1}'
    if path.endswith("parts"):
        body = [b'{"a":', memoryview(b"12"), bytearray(b"3}")]
    elif path.endswith("big"):
        body = BIG
    hold = extensions["attend.hold"] if path.startswith("/fast") else None
    await send_body(send, 201, body, [(b"x-request-id", b"r-1"), (b"retry-after", b"1")], hold=hold)


class Unlogged(GuardedProtocol):
    """As the service runs it: no uvicorn access log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.access_log = False


@pytest.fixture(scope="module")
def server():
    with uvicorn_in_thread(app, Unlogged, access_log=False) as port:
        yield port


def _exchange(port: int, raw: bytes, responses: int) -> bytes:
    """Send `raw`, read until `responses` complete responses (or the server closes)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        sock.settimeout(10)
        data = b""
        while True:
            heads = [m.end() for m in re.finditer(rb"\r\n\r\n", data)]
            lengths = [int(x) for x in re.findall(rb"content-length: (\d+)", data)]
            if len(heads) >= responses and len(data) >= heads[responses - 1] + lengths[responses - 1]:
                return data
            chunk = sock.recv(1 << 20)
            if not chunk:
                return data
            data += chunk


def _closed_after(port: int, raw: bytes) -> tuple[bytes, bool]:
    """What the server sends for `raw`, and whether it closed the connection after it."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        sock.settimeout(5)
        data = b""
        try:
            while chunk := sock.recv(1 << 20):
                data += chunk
        except TimeoutError:
            return data, False
    return data, True


def _request(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: 2\r\n{extra}\r\n{{}}".encode()


def _undated(data: bytes) -> bytes:
    return re.sub(rb"date: [^\r]*\r\n", b"date: -\r\n", data)


@pytest.mark.parametrize("kind", ["", "parts", "big"])
def test_the_same_bytes_as_uvicorns_send(server, kind):
    fast = _exchange(server, _request(f"/fast{kind}"), 1)
    slow = _exchange(server, _request(f"/slow{kind}"), 1)
    assert _undated(fast) == _undated(slow)
    head, body = fast.split(b"\r\n\r\n", 1)
    assert head.split(b"\r\n") == [b"HTTP/1.1 201 Created", head.split(b"\r\n")[1], b"server: uvicorn",
                                   b"content-type: application/json", b"content-length: %d" % len(body),
                                   b"x-request-id: r-1", b"retry-after: 1"]
    assert body == {"": b'{"a":1}', "parts": b'{"a":123}', "big": BIG}[kind]


def test_kept_alive_and_pipelined_in_order(server):
    raw = b"".join(_request(p) for p in ("/fast", "/fastparts", "/slow", "/fastbig", "/fast"))
    data = _exchange(server, raw, 5)
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in data.split(b"HTTP/1.1 201 Created")[1:]]
    assert [b[:9] for b in bodies] == [b'{"a":1}', b'{"a":123}', b'{"a":1}', BIG[:9], b'{"a":1}']
    assert b"connection: close" not in data


@pytest.mark.parametrize("path", ["/fast", "/fastparts", "/slow"])
@pytest.mark.parametrize("how", ["close", "http/1.0"])
def test_connection_close_is_said_and_done(server, path, how):
    raw = _request(path, "Connection: close\r\n") if how == "close" else _request(path, version="1.0")
    data, closed = _closed_after(server, raw)
    assert closed, data
    assert data.count(b"HTTP/1.1 201") == 1 and b"\r\nconnection: close\r\n" in data, data


def test_the_service_answers_through_it(repository):
    """The real service: the book's toy answer, kept alive over one connection, then closed."""
    body = json.dumps(toy_request()).encode()
    one = b"POST /attend HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-ID: t-%d\r\n" \
          b"Content-Length: %d\r\n%s\r\n"
    with running_service(repository) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        raw = b"".join(one % (i, len(body), b"") + body for i in range(3))
        data, closed = _closed_after(port, raw + one % (3, len(body), b"Connection: close\r\n") + body)
    assert closed
    responses = data.split(b"HTTP/1.1 ")[1:]
    assert [r[:3] for r in responses] == [b"200"] * 4
    for i, response in enumerate(responses):
        head, answer = response.split(b"\r\n\r\n", 1)
        assert b"\r\nx-request-id: t-%d\r\n" % i in head + b"\r\n"
        assert b"\r\ncontent-length: %d" % len(answer) in head
        assert json.loads(answer)["outputs"] == [[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]
    assert (b"connection: close" in responses[-1]) and all(b"connection: close" not in r for r in responses[:-1])
