"""The inference routes over HTTP: an adapter (`HttpExchange`) that reads a request's body and writes its
answer, for the core's one request sequence (service.core.exchange.serve). `inference_route` is the one
table of inference routes; `RequestContext` gives every other route its request ID and access log line.

They are plain ASGI apps, not FastAPI routes: FastAPI's request handling costs more than a small request's
whole run (`python bench/asgi_overhead.py`); `service.http.app.AttendApp` calls them first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.core.cost import Cost
from service.core.dataplane import Dataplane
from service.core.errors import ClientGone, ServiceError
from service.core.exchange import Answer
from service.core.inflate import Inflater, encoding_of
from service.core.logs import log_access, new_request_id, request_id
from service.http.extensions import Headers, disconnect_probe, read_body, send_body
from service.protocols.codec import Codec, Target
from service.protocols.v2 import error_json

log = logging.getLogger("service")


_NO_TARGET: Target = (None, None)
# The routes of the request spans (OpenTelemetry's http.route: the path's template, not the path).
_V2_ROUTE = "/v2/models/{model_name}/infer"
_V2_VERSION_ROUTE = "/v2/models/{model_name}/versions/{model_version}/infer"


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
    """An inference route as an ASGI app: its codec, how the route names its target, and the settings it
    reads on every request (bound here, not looked up on the app's state)."""

    def __init__(self, dataplane: Dataplane, codec: Codec, settings: Settings, target_of: Any = _attend_target):
        self.dataplane = dataplane
        self.max_body_bytes = settings.max_body_bytes
        self.max_inflate_ratio = settings.max_inflate_ratio
        self.codec = codec
        self.target_of = target_of  # the route's (model, version) from the path
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
            extra.append((b"access-control-expose-headers",
                          b"X-Request-ID, Retry-After, X-Model-Version, traceresponse"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.dataplane.serve(HttpExchange(self, scope, receive, send))


class HttpExchange:
    """One HTTP inference request, for service.core.exchange.serve: its body read (bounded, inflated where
    compressed) and its answer or error written, with the request ID and CORS headers."""

    __slots__ = ("endpoint", "scope", "receive", "send_message", "headers", "target", "authorization", "timeout_ms",
                 "arrived", "rid", "extra", "disconnected", "codec", "hold")
    protocol = "http"
    method = "POST"

    def __init__(self, endpoint: InferenceEndpoint, scope: Scope, receive: Receive, send: Send):
        self.endpoint = endpoint
        self.codec = endpoint.codec
        self.scope = scope
        self.receive = receive
        self.send_message = send
        headers = self.headers = dict(scope["headers"])
        self.target = endpoint.target_of(scope["path"])
        self.authorization = headers.get(b"authorization")
        self.timeout_ms = headers.get(b"x-request-timeout-ms")
        extensions = scope.get("extensions") or {}
        self.arrived = extensions.get("attend.arrived")
        self.hold = extensions.get("attend.hold")
        self.disconnected = disconnect_probe(extensions, receive)
        self.rid, rid_header = new_request_id(headers.get(b"x-request-id"))
        self.extra = [(b"x-request-id", rid_header)]
        if endpoint.cors:
            endpoint._cors(headers, self.extra)

    def latest(self) -> float | None:
        return None

    def path(self, model: str) -> str:
        """The path as the client sent it (percent-encoded: a %0a stays three characters)."""
        return _logged_path(self.scope)

    def cancelled(self) -> ServiceError:
        return ClientGone("the request was cancelled")

    async def body(self, cost: Cost, until: float) -> bytes | memoryview:
        endpoint, headers = self.endpoint, self.headers
        codec = self.codec
        encoding = headers.get(b"content-encoding")
        if encoding is not None:
            encoding = encoding_of(encoding)
        aligned_at = codec.aligned_at(headers) if encoding is None else None
        claim = None if aligned_at is None else (self.scope.get("extensions") or {}).get("attend.body")
        expected = codec.expected if encoding is None else None
        body = await read_body(self.receive, headers, endpoint.max_body_bytes, claim, aligned_at or 0, cost, expected)
        if encoding is not None:
            body = await self._inflate(body, encoding, cost, until)
        cost.base = len(body)
        return body

    async def _inflate(self, body: bytes, encoding: str, cost: Cost, until: float) -> bytes:
        """The body inflated: on the event loop up to ATTEND_INLINE_DECODE_BYTES of it (the inflated size,
        not the compressed one, decides), on a decode thread past that."""
        endpoint = self.endpoint
        dataplane = endpoint.dataplane
        inflater = Inflater(body, encoding, endpoint.max_body_bytes, endpoint.max_inflate_ratio, cost, len(body))
        if not inflater.run(dataplane.inline_decode_bytes):
            await dataplane.in_thread(until, inflater.run)
        return inflater.body()

    async def send(self, answer: Answer) -> None:
        extra = self.extra
        await send_body(self.send_message, 200, answer.body, [*extra, *answer.headers] if answer.headers else extra,
                        answer.content_type, self.hold)

    async def refuse(self, error: ServiceError) -> None:
        extra = [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
        await send_body(self.send_message, error.status, self.codec.error_body(error), [*self.extra, *extra],
                        hold=self.hold)

    # Tracing (service.core.tracing; only while it is on): OpenTelemetry's conventions for HTTP servers.

    def span_start(self) -> tuple[str, dict[str, Any], str]:
        scope, headers = self.scope, self.headers
        path = scope["path"]
        route = path if path == "/attend" else _V2_VERSION_ROUTE if self.target[1] is not None else _V2_ROUTE
        attributes: dict[str, Any] = {"http.request.method": "POST", "http.route": route, "url.path": path,
                                      "url.scheme": scope.get("scheme", "http"),
                                      "network.protocol.version": scope.get("http_version", "1.1")}
        server, client = scope.get("server"), scope.get("client")
        if server:
            attributes["server.address"], attributes["server.port"] = server[0], server[1] or 0
        if client:
            attributes["client.address"], attributes["client.port"] = client[0], client[1] or 0
        agent = headers.get(b"user-agent")
        if agent is not None:
            attributes["user_agent.original"] = agent.decode("latin-1")[:200]
        form = "binary" if b"inference-header-content-length" in headers else "json"
        encoding = headers.get(b"content-encoding")
        if encoding is not None:
            form = f"{form}+{encoding.decode('latin-1')[:20]}"
        return f"POST {route}", attributes, form

    def span_end(self, status: int) -> tuple[dict[str, Any], bool]:
        # A client gone before its answer has no status (nothing was sent): an error, as a 5xx.
        return ({"http.response.status_code": status} if status else {}), not status or status >= 500

    def traced(self, traceresponse: str) -> None:
        self.extra.append((b"traceresponse", traceresponse.encode()))


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
