"""The contract between the inference endpoints and the server under them, with a plain-ASGI fallback
for every part: under `python -m service` the service's own HTTP protocol
(service.http.protocol.GuardedProtocol) offers faster ways as extensions of the ASGI scope
(`scope["extensions"]`); under any other ASGI server (`uvicorn --factory service.asgi:create_app`,
Ray Serve, a test client) the same calls take ASGI's own way.

    extension               set by (GuardedProtocol.)     signature                      fallback when absent
    "attend.arrived"        on_headers_complete           float: time.monotonic() when   time.monotonic() when the
                                                          the request's headers were in  endpoint starts
    "attend.body"           on_headers_complete, for a    (aligned_at: int) ->           receive() until the last
                            body with a Content-Length    Future[memoryview | None]:     message (read_body), bytes
                                                          the whole body in one buffer,
                                                          None if the client went; in
                                                          place of receive()
    "attend.hold"           on_headers_complete           (writes: int) -> None: the     each message its own write
                                                          next `writes` writes go out
                                                          with the one after them
    "attend.disconnected"   on_headers_complete           () -> bool: the client has     a receive() cancelled at
                                                          gone                           once (disconnect_probe)

The uvicorn internals that service.http.protocol and service.http.server touch (a change of any of
them breaks the service, hence the upper bound on uvicorn in pyproject.toml;
tests/service/test_layers.py checks that each exists in the installed uvicorn):

    uvicorn.protocols.http.httptools_impl: HttpToolsProtocol (its connection_made, data_received,
        on_message_begin, on_headers_complete, on_body, on_message_complete, on_response_complete,
        connection_lost, shutdown, and its fields cycle, connections, tasks, flow, pipeline, url, headers,
        scope, app, config, loop, transport, parser);
    its RequestResponseCycle's fields: body, more_body, disconnected, response_started, response_complete,
        waiting_for_100_continue;
    uvicorn.protocols.http.flow_control.FlowControl: read_paused, resume_reading;
    uvicorn.Server: startup (given no socket, it makes no server: a worker of several accepts on its own,
        service.http.accept), shutdown, handle_exit, servers, server_state (tasks, connections), lifespan,
        started, config (http_protocol_class, loaded_app, backlog);
    uvicorn.supervisors.multiprocess: Multiprocess (processes, sockets, should_exit, terminate_all,
        handle_hup), Process (config, _server), whose module-level name run_workers replaces while
        the supervisor runs;
    uvicorn.Config: a callable app with factory=True, unpickled and called in each worker (run_workers's
        factory, with the folder where the start's processes share the graphs' times).
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.types import Receive, Send

from service.core.cost import Cost
from service.core.errors import ClientGone, PayloadTooLarge

JSON = b"application/json"
Headers = list[tuple[bytes, bytes]]


def _nothing(headers: dict[bytes, bytes], length: int) -> int:
    return 0


async def read_body(receive: Receive, headers: dict[bytes, bytes], limit: int, claim: Any = None,
                    aligned_at: int = 0, cost: Cost | None = None, expected: Any = None,
                    named: str = "ATTEND_MAX_BODY_BYTES") -> Any:
    """The body, refused with 413 as soon as it is known to be larger than `limit`, its bytes held in
    `cost` before they are read (503 + Retry-After where the in-flight budget has no room for them; a
    body of unknown length as it comes), with what its decode will hold at least (`expected(headers,
    length)`, the codec's).
    `claim`: the server's way to have it written into one buffer as it comes ("attend.body", where it
    offers that: service.http.transport.BodySink), the byte at `aligned_at` 64-byte aligned; the body is
    then a memoryview, not bytes. `named`: the limit, as the refusal names it."""
    length = headers.get(b"content-length")
    size = int(length) if length is not None and length.isdigit() else None
    if size is not None and size > limit:
        raise PayloadTooLarge(f"the body has {size} bytes; the limit is {limit} ({named})",
                              expected=limit, received=size)
    expect = expected or _nothing
    if claim is not None:
        if cost is not None:
            cost.hold((size or 0) + expect(headers, size or 0), "this body")
        body = await claim(aligned_at)
        if body is None:
            raise ClientGone("the client disconnected before sending its whole body")
        return body
    if cost is not None and size is not None:
        cost.hold(2 * size + expect(headers, size), "this body")  # the server's pieces of it, and their join
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone("the client disconnected before sending its body")
    body = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes ({named})",
                                  expected=limit)
        return body
    chunks, received = [body], len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected before sending its whole body")
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes ({named})",
                                  expected=limit)
        if cost is not None and size is None:
            cost.hold(2 * received + expect(headers, received), "this body")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_body(send: Send, status: int, body: bytes | list, headers: Headers, content_type: bytes = JSON,
                    hold: Any = None) -> None:
    """The response, head and body. `hold`: the server's way to send head and body in one write (see
    service.http.transport.CoalescingTransport), where it offers one. A body given as a list of parts
    (bytes-like, each of one-byte items) goes out part by part, in the same one write; joined, where the
    server offers no hold."""
    listed = body.__class__ is list
    length = sum(map(len, body)) if listed else len(body)
    head = [(b"content-type", content_type), (b"content-length", b"%d" % length), *headers]
    parts: Any = ()
    if listed:
        if hold is None or len(body) == 1:
            body = b"".join(body)
        else:
            parts, body = body[:-1], body[-1]
    if hold is not None:
        hold(len(parts) + 1)
    await send({"type": "http.response.start", "status": status, "headers": head})
    for part in parts:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": body})


def disconnect_probe(extensions: dict, receive: Receive) -> Any:
    """Whether the client has gone, without waiting. Where the server offers it ("attend.disconnected",
    service.http.protocol.GuardedProtocol), its connection's state is read; else a receive cancelled at once
    (Starlette's way), which costs more: anyio's cancel formats the task's repr."""
    gone = extensions.get("attend.disconnected")
    if gone is not None:
        async def has_gone() -> bool:
            return gone()

        return has_gone

    async def is_disconnected() -> bool:
        message: dict[str, Any] = {}
        with anyio.CancelScope() as scope:
            scope.cancel()
            message = await receive()
        return message.get("type") == "http.disconnect"

    return is_disconnected
