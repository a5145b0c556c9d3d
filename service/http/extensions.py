"""The server's side of the inference endpoints' contract, with a plain-ASGI fallback for each:
the body read (bounded), the response written, and whether the client has gone. Under `python -m
service` the service's own protocol (service.http.protocol.GuardedProtocol) offers faster ways as
extensions of the ASGI scope; under any other ASGI server the same calls take ASGI's own way."""

from __future__ import annotations

from typing import Any

import anyio
from starlette.types import Receive, Send

from service.core.errors import ClientGone, PayloadTooLarge

JSON = b"application/json"
Headers = list[tuple[bytes, bytes]]


async def read_body(receive: Receive, headers: dict[bytes, bytes], limit: int, claim: Any = None,
                    aligned_at: int = 0) -> Any:
    """The body, refused with 413 as soon as it is known to be larger than `limit`. `claim`: the
    server's way to have it written into one buffer as it comes ("attend.body", where it offers
    that: service.http.protocol.BodySink), the byte at `aligned_at` 64-byte aligned; the body is then a
    memoryview, not bytes."""
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the body has {int(length)} bytes; the limit is {limit}", expected=limit,
                              received=int(length))
    if claim is not None:
        body = await claim(aligned_at)
        if body is None:
            raise ClientGone("the client disconnected before sending its whole body")
        return body
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone("the client disconnected before sending its body")
    body = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes", expected=limit)
        return body
    chunks, size = [body], len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected before sending its whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes", expected=limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_body(send: Send, status: int, body: bytes | list, headers: Headers, content_type: bytes = JSON,
                    hold: Any = None, respond: Any = None) -> None:
    """The response, head and body. `respond`: the server's way to write a whole response at once
    ("attend.respond", service.http.protocol.GuardedProtocol), where it offers one and can; else `hold`:
    its way to send head and body in one write (see service.http.protocol.CoalescingTransport), where it
    offers one. A body given as a list of parts (bytes-like, each of one-byte items) goes out part
    by part, in the same one write; joined, where the server offers neither."""
    listed = body.__class__ is list
    length = sum(map(len, body)) if listed else len(body)
    head = [(b"content-type", content_type), (b"content-length", b"%d" % length), *headers]
    if respond is not None and respond(status, head, body):
        return
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
    (Starlette's way), which costs ~30 us more: anyio's cancel formats the task's repr."""
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
