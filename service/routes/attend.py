"""POST /attend: the codec of the service's own JSON protocol, as a plain ASGI app.

It reads the body, decodes it (service.decode), hands the request to the dataplane (batching,
deadline, session run) with /attend's encoder, and sends the body or the one error body. It is a
plain ASGI app rather than a FastAPI route because FastAPI's request handling costs ~45 us a request
(measured: `python bench/asgi_overhead.py`), twice the book's toy request's whole session run;
`service.app` calls it before FastAPI's stack (or through a route, when CORS needs the middleware).
The FastAPI route below only documents it in the OpenAPI schema.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import orjson
from fastapi import APIRouter
from starlette.types import Receive, Scope, Send

from service.auth import check_api_key
from service.dataplane import encode_attend
from service.errors import (
    ClientGone,
    InvalidRequest,
    NotReady,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
)
from service.middleware import log_access, new_request_id, request_id
from service.schemas import AttendRequest, AttendResponse, error_responses, toy_request

log = logging.getLogger("service")
router = APIRouter()
_JSON = [(b"content-type", b"application/json")]


@router.post(
    "/attend",
    response_model=AttendResponse,
    responses=error_responses(400, 401, 404, 413, 415, 422, 503, 504),  # type: ignore[arg-type]
    summary="Attention outputs and weights for queries, keys, values and valid lengths",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": AttendRequest.model_json_schema(),
        "example": toy_request(),
    }}}},
)
async def attend_documented() -> None:
    """The OpenAPI entry of POST /attend; requests are served by `AttendEndpoint`, routed before it."""
    raise NotImplementedError("POST /attend is served by service.routes.attend.AttendEndpoint")


async def read_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be larger than `limit`."""
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the body has {int(length)} bytes; the limit is {limit}", expected=limit,
                              received=int(length))
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


def check_media_type(headers: dict[bytes, bytes]) -> None:
    raw = headers.get(b"content-type")
    if raw is None or raw == b"application/json":
        return
    media = raw.decode("latin-1").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {media[:100]}",
                                   expected="application/json", received=media[:100])


def deadline(headers: dict[bytes, bytes], default_s: float) -> float:
    timeout = default_s
    header = headers.get(b"x-request-timeout-ms")
    if header is not None:
        try:
            timeout = min(timeout, float(header) / 1000)
        except ValueError:
            raise InvalidRequest("X-Request-Timeout-Ms must be a number of milliseconds", field="X-Request-Timeout-Ms",
                                 received=header.decode("latin-1")[:100]) from None
    return time.monotonic() + timeout


async def send_body(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ServiceError, headers: list[tuple[bytes, bytes]]) -> int:
    extra = [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send_body(send, error.status, orjson.dumps(error.body()), [*headers, *extra])
    return error.status


def disconnect_probe(receive: Receive) -> Any:
    """Whether the client has gone, without waiting: a receive cancelled at once (Starlette's way)."""
    async def is_disconnected() -> bool:
        message: dict[str, Any] = {}
        with anyio.CancelScope() as scope:
            scope.cancel()
            message = await receive()
        return message.get("type") == "http.disconnect"

    return is_disconnected


class AttendEndpoint:
    """POST /attend. What it reads on every request is bound here, not looked up on the app's
    state (a Starlette State attribute costs a Python-level __getattr__ each)."""

    def __init__(self, state: Any):
        self.state = state  # readiness (`serving`) lives there: the lifespan and the server change it
        self.settings = state.settings
        self.metrics = state.metrics
        self.api_keys: tuple[bytes, ...] = state.api_keys
        self.dataplane: Any = None  # bound by the lifespan, once the models are loaded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Served with its request ID and access log line (service.middleware's, inline here: this
        is the path of every request, and RequestContext's wrapper of `send` costs a layer)."""
        start = time.perf_counter()
        headers = dict(scope["headers"])
        rid, rid_header = new_request_id(headers.get(b"x-request-id"))
        token = request_id.set(rid)
        extra = [(b"x-request-id", rid_header)]
        status = 500
        try:
            status = await self._serve(scope, headers, receive, send, extra, start)
        finally:
            log_access("POST", "/attend", status, time.perf_counter() - start)
            request_id.reset(token)

    async def _serve(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send,
                     extra: list[tuple[bytes, bytes]], start: float) -> int:
        """The response's status, once sent (0: the client went away, nothing was sent)."""
        metrics = self.metrics
        dataplane = self.dataplane
        # Not `ready`: that turns off at SIGTERM, while requests sent before it still get served
        # (uvicorn closes the listener and kept-alive connections, so nothing newer reaches here).
        if dataplane is None or not self.state.serving:
            metrics.model("-").status(503).inc()
            return await send_error(send, NotReady("the service is not ready", headers={"Retry-After": "1"}), extra)
        model = "-"
        dataplane.in_flight += 1
        try:
            if self.api_keys:
                check_api_key(headers.get(b"authorization"), self.api_keys)
            check_media_type(headers)
            settings = self.settings
            until = deadline(headers, settings.request_timeout_s)
            body = await read_body(receive, headers, settings.max_body_bytes)
            request = await dataplane.decode_async(body, until)
            model = request.model.name
            content = await dataplane.infer(request, until, encode_attend, disconnect_probe(receive))
        except ServiceError as e:
            metrics.model(e.model or model).status(e.status).inc()
            if isinstance(e, ClientGone):
                return 0  # nobody to answer
            return await send_error(send, e, extra)
        except Exception:
            log.exception("unhandled error on POST /attend")
            metrics.model(model).status(500).inc()
            return await send_error(send, ServiceError("internal server error"), extra)
        finally:
            dataplane.in_flight -= 1
        children = metrics.model(model)
        children.status(200).inc()
        children.latency.observe(time.perf_counter() - start)
        await send_body(send, 200, content, extra)
        return 200
