"""What every protocol's inference route does, once, around its codec (service.protocols.codec):
the request ID and access log line, readiness, the API key, the deadline, the body (bounded), the
in-flight count, the metrics, CORS, and turning errors into responses in the codec's error body.
`inference_route` is the one table of inference routes; `RequestContext` gives every other route its
request ID and access log line.

These are plain ASGI apps rather than FastAPI routes because FastAPI's request handling costs ~45 us a
request (measured: `python bench/asgi_overhead.py`), twice the book's toy request's whole session
run; `service.http.app.AttendApp` calls them before FastAPI's stack, with CORS on or off.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.core.batching import Encoder
from service.core.cost import Cost
from service.core.dataplane import Dataplane
from service.core.errors import ServiceError
from service.core.inflate import Inflater, encoding_of
from service.core.logs import log_access, new_request_id, request_id
from service.core.request import Request
from service.http.extensions import Headers, disconnect_probe, read_body, send_body
from service.protocols.codec import Codec, Target
from service.protocols.v2 import error_json

log = logging.getLogger("service")


_NO_TARGET: Target = (None, None)


def _attend_target(path: str) -> Target:
    return _NO_TARGET


def inference_route(method: str, path: str) -> str | None:
    """Which inference endpoint serves this request ("attend", "v2"), or None: not an inference route."""
    if method == "POST":
        if path == "/attend":
            return "attend"
        if path.startswith("/v2/models/") and path.endswith("/infer"):
            return "v2"
    return None


def _logged_path(scope: Scope) -> str:
    """The path as the client sent it (percent-encoded: a %0a stays three characters), for the log."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw is not None else scope["path"]


def error_body(path: str, error: ServiceError) -> bytes:
    """`error`'s body as the protocol of `path` writes it: under /v2 the Open Inference Protocol's
    `{"error": "<message>"}`, elsewhere the service's one error body. For every answer that is not an
    inference endpoint's own (FastAPI's routes, the transport's refusals)."""
    return error_json(error) if path.startswith("/v2") else orjson.dumps(error.body())


class InferenceEndpoint:
    """An inference route: its codec, and how the route names its target. What it reads on every
    request is bound here, not looked up on the app's state (a Starlette State attribute costs a
    Python-level __getattr__ each)."""

    def __init__(self, dataplane: Dataplane, codec: Codec, settings: Settings, target_of: Any = _attend_target):
        self.dataplane = dataplane
        self.max_body_bytes = settings.max_body_bytes
        self.max_inflate_ratio = settings.max_inflate_ratio
        self.codec = codec
        self.target_of = target_of  # the route's (model, version) from the path
        # The codec's methods, bound once: each is called on every request.
        self.check_media_type = codec.check_media_type
        self.expected = codec.expected
        self.aligned_at = codec.aligned_at
        self.decode = codec.decode
        self.response = codec.response
        self.error_body = codec.error_body
        origins = settings.cors_origin_list()
        self.cors_all = "*" in origins
        self.cors = frozenset(o.encode("latin-1") for o in origins)

    def _cors(self, headers: dict[bytes, bytes], extra: Headers) -> None:
        """CORS on a response (Starlette's CORSMiddleware answers the preflight)."""
        origin = headers.get(b"origin")
        if origin is not None and (self.cors_all or origin in self.cors):
            extra.append((b"access-control-allow-origin", b"*" if self.cors_all else origin))
            if not self.cors_all:
                extra.append((b"vary", b"Origin"))
            extra.append((b"access-control-expose-headers", b"X-Request-ID, Retry-After, X-Model-Version"))

    def model_of(self, target: Target) -> str:
        """The model's name for the metrics' label before the body is decoded: a label only for models
        that exist ("-" otherwise: a client's made-up names must not grow the metrics)."""
        name = target[0]
        return name if name is not None and self.dataplane.registry.get(name) is not None else "-"

    # The rest: the same for every protocol.

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Served with its request ID and access log line (service.core.logs', inline here: this
        is the path of every request, and RequestContext's wrapper of `send` costs a layer)."""
        start = time.perf_counter()
        headers = dict(scope["headers"])
        rid, rid_header = new_request_id(headers.get(b"x-request-id"))
        token = request_id.set(rid)
        extra = [(b"x-request-id", rid_header)]
        if self.cors:
            self._cors(headers, extra)
        status = 500
        try:
            status = await self._serve(scope, headers, receive, send, extra, start)
        finally:
            log_access("POST", _logged_path(scope), status, time.perf_counter() - start)
            request_id.reset(token)

    async def send_error(self, send: Send, error: ServiceError, headers: Headers, hold: Any = None,
                         respond: Any = None) -> int:
        extra = [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        await send_body(send, error.status, self.error_body(error), [*headers, *extra], hold=hold, respond=respond)
        return error.status

    async def _read_and_decode(self, scope: Scope, target: Target, headers: dict[bytes, bytes], receive: Receive,
                               until: float, cost: Cost) -> tuple[Request, Encoder]:
        """The body, read (inflated where compressed) and decoded, within the request's deadline, each
        stage's bytes held in `cost` before it makes them."""
        dataplane = self.dataplane
        with dataplane.within(until):
            encoding = headers.get(b"content-encoding")
            if encoding is not None:
                encoding = encoding_of(encoding)
            aligned_at = self.aligned_at(headers) if encoding is None else None
            claim = None if aligned_at is None else (scope.get("extensions") or {}).get("attend.body")
            expected = self.expected if encoding is None else None
            body = await read_body(receive, headers, self.max_body_bytes, claim, aligned_at or 0, cost, expected)
            if encoding is not None:
                body = await self._inflate(body, encoding, cost, until)
            cost.base = len(body)
            if cost.base > dataplane.inline_decode_bytes:
                # While it waits for a decode thread: the body alone (its pieces joined, a compressed one
                # dropped), and what its decode will hold at least. (Decoded at once, the codec holds what
                # its decode holds first thing.)
                cost.hold(cost.base + self.expected(headers, cost.base), "this body")
            return await dataplane.decode_async(until, self.decode, dataplane, target, headers, body, cost)

    async def _inflate(self, body: bytes, encoding: str, cost: Cost, until: float) -> bytes:
        """The body inflated: on the event loop up to ATTEND_INLINE_DECODE_BYTES of it (the inflated size,
        not the compressed one, decides), on a decode thread past that."""
        dataplane = self.dataplane
        inflater = Inflater(body, encoding, self.max_body_bytes, self.max_inflate_ratio, cost, len(body))
        if not inflater.run(dataplane.inline_decode_bytes):
            await dataplane.in_thread(until, inflater.run)
        return inflater.body()

    async def _serve(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send,
                     extra: Headers, start: float) -> int:
        """The response's status, once sent (0: the client went away, nothing was sent)."""
        dataplane = self.dataplane
        extensions = scope.get("extensions") or {}
        hold = extensions.get("attend.hold")
        respond = extensions.get("attend.respond")
        try:
            dataplane.admit(headers.get(b"authorization"))
        except ServiceError as e:
            dataplane.failed("-", e)
            return await self.send_error(send, e, extra, hold, respond)
        model = "-"
        version: int | str | None = None  # for the statistics: the version asked for, then the one decoded
        cost = dataplane.cost()
        try:
            target = self.target_of(scope["path"])
            model, version = self.model_of(target), target[1]
            self.check_media_type(headers)
            until = dataplane.deadline(headers.get(b"x-request-timeout-ms"), extensions.get("attend.arrived"))
            request, encode = await self._read_and_decode(scope, target, headers, receive, until, cost)
            model, version = request.model.name, request.model.config.version
            content = await dataplane.infer(request, until, encode, disconnect_probe(extensions, receive), cost)
        except ServiceError as e:
            cost.release()
            if not dataplane.failed(e.model or model, e, time.perf_counter() - start, version):
                return 0
            return await self.send_error(send, e, extra, hold, respond)
        except Exception:
            cost.release()
            log.exception("unhandled error on POST %s", _logged_path(scope)[:200])
            error = ServiceError("internal server error")
            dataplane.failed(model, error, time.perf_counter() - start, version)
            return await self.send_error(send, error, extra, hold, respond)
        finally:
            dataplane.release()
        dataplane.answered(model, 200, time.perf_counter() - start, request.model)
        body, more, content_type = self.response(content)
        try:
            await send_body(send, 200, body, [*extra, *more] if more else extra, content_type, hold, respond)
        finally:
            cost.release()  # the answer is written (or handed to the socket's buffer)
        return 200


class RequestContext:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or inference_route(scope["method"], scope["path"]) is not None:
            await self.app(scope, receive, send)  # the inference routes do their own (InferenceEndpoint)
            return
        rid, rid_bytes = new_request_id(next((v for k, v in scope["headers"] if k == b"x-request-id"), None))
        token = request_id.set(rid)
        start = time.perf_counter()
        status = 0  # no response: the client went away first

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid_bytes)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log_access(scope["method"], _logged_path(scope), status, time.perf_counter() - start)
            request_id.reset(token)
