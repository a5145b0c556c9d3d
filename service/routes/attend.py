"""POST /attend: thin. It decodes (service.dataplane; large bodies in a worker thread) and queues
the request for service.batching, which runs and encodes it; no session runs on the event loop."""

from __future__ import annotations

import time

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.batching import Job
from service.errors import InvalidRequest, NotReady, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.schemas import AttendRequest, AttendResponse, error_responses, toy_request

router = APIRouter()

_ERRORS = error_responses(400, 401, 404, 413, 415, 422, 503, 504)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be larger than `limit`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the body has {length} bytes; the limit is {limit}", expected=limit,
                              received=int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes", expected=limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _check_media_type(request: Request) -> None:
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {media}",
                                   expected="application/json", received=media)


def _deadline(request: Request, default_s: float) -> float:
    timeout = default_s
    header = request.headers.get("x-request-timeout-ms")
    if header is not None:
        try:
            timeout = min(timeout, float(header) / 1000)
        except ValueError:
            raise InvalidRequest("X-Request-Timeout-Ms must be a number of milliseconds", field="X-Request-Timeout-Ms",
                                 received=header) from None
    return time.monotonic() + timeout


@router.post(
    "/attend",
    response_model=AttendResponse,
    responses=_ERRORS,  # type: ignore[arg-type]
    summary="Attention outputs and weights for queries, keys, values and valid lengths",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": AttendRequest.model_json_schema(),
        "example": toy_request(),
    }}}},
)
async def attend(request: Request) -> Response:
    state = request.app.state
    # Not `ready`: that turns off at SIGTERM, while requests sent before it still get served
    # (uvicorn closes the listener and kept-alive connections, so nothing newer reaches here).
    if not state.serving:
        raise NotReady("the service is not ready", headers={"Retry-After": "1"})
    settings = state.settings
    start = time.perf_counter()
    state.metrics.in_flight.inc()
    model = "-"
    try:
        _check_media_type(request)
        deadline = _deadline(request, settings.request_timeout_s)
        body = await read_body(request, settings.max_body_bytes)
        if len(body) <= settings.inline_decode_bytes:
            decoded = state.dataplane.decode(body)
        else:
            decoded = await anyio.to_thread.run_sync(state.dataplane.decode, body, limiter=state.limiter)
        model = decoded.model.name
        content = await state.scheduler.submit(Job(decoded, deadline, request.is_disconnected))
    except ServiceError as e:
        state.metrics.requests.labels(e.model or model, str(e.status)).inc()
        raise
    except Exception:
        state.metrics.requests.labels(model, "500").inc()
        raise
    finally:
        state.metrics.in_flight.dec()
    state.metrics.requests.labels(model, "200").inc()
    state.metrics.latency.labels(model).observe(time.perf_counter() - start)
    return Response(content, media_type="application/json")
