"""`create_app(settings)`: the FastAPI app, wired in named steps; its error handlers and key checks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import Settings, get_settings
from service.core.dataplane import Dataplane
from service.core.errors import (
    HTTPError,
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    ServiceError,
)
from service.core.keys import check_api_key
from service.core.logs import flush_logs
from service.core.metrics import Metrics
from service.core.runtime import Registry
from service.http.endpoint import InferenceEndpoint, RequestContext, error_body, inference_route
from service.http.routes import attend, health, models, page, v2
from service.protocols.attend import AttendCodec
from service.protocols.json_process import JsonProcesses, NotStarted
from service.protocols.v2 import InferCodec, parse_path

log = logging.getLogger("service")

# Swagger UI's and ReDoc's JavaScript and CSS, bundled by the fastapi-offline package: /docs and
# /redoc work on a machine without internet (FastAPI's defaults load them from a CDN).
_DOCS_ASSETS = Path(fastapi_offline.__file__).parent / "static"
_ASSETS_URL = "/docs-assets"


class AttendApp(FastAPI):
    """FastAPI, with the inference routes (POST /attend, POST /v2/models/.../infer) handed to their
    endpoints before FastAPI's own request handling (routing, middleware, exception handlers,
    telemetry hooks). That handling costs a small request more than its attention does (`python
    bench/asgi_overhead.py`). Everything else goes through FastAPI as usual."""

    inference: dict[str, ASGIApp]  # service.http.endpoint.inference_route's names -> their endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = inference_route(scope["method"], scope["path"])
            if route is not None:
                return await self.inference[route](scope, receive, send)
        await super().__call__(scope, receive, send)


@asynccontextmanager
async def _lifespan(app: AttendApp) -> AsyncIterator[None]:
    """The core opened (models loaded, unless given, and warmed up; the batching started) before the
    app takes requests, and closed after."""
    dataplane = app.state.dataplane
    count = app.state.settings.resolved_json_processes()
    processes = None
    if count:  # started before the core, on a thread: their imports take a few hundred ms
        try:
            processes = await asyncio.to_thread(JsonProcesses, count)
        except NotStarted as e:  # the service works without them, as with ATTEND_JSON_PROCESSES=0
            log.warning("%s", e)
    dataplane.json_processes = processes
    try:
        await dataplane.open()
        log.info(access_line(app.state.settings, dataplane.model_control))
        try:
            yield
        finally:
            await dataplane.close()
            flush_logs()
    finally:
        if processes is not None:
            processes.close()


def access_line(settings: Settings, model_control: bool) -> str:
    """The start-up line that says who may call: whether API keys are required, and who may load models."""
    keys, admins = len(settings.api_key_list()), len(settings.admin_key_list())
    calls = (f"API keys: required ({keys} in ATTEND_API_KEYS) for /attend, /v2, /models, /metrics and gRPC; "
             "the health routes and the page are open" if keys else
             "API keys: none (ATTEND_API_KEYS is empty): every route is open to whoever reaches the port")
    control = (f"an admin key ({admins} in ATTEND_ADMIN_KEYS)" if admins else
               "open (ATTEND_MODEL_CONTROL=true)" if model_control else "off")
    return f"{calls}; model control: {control}"


def _offline_docs(app: FastAPI) -> None:
    """/docs and /redoc with their assets served by the service (FastAPI's documented self-hosting)."""
    app.mount(_ASSETS_URL, StaticFiles(directory=_DOCS_ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url,
                                   swagger_js_url=f"{root}{_ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{_ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{_ASSETS_URL}/favicon.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{_ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{_ASSETS_URL}/favicon.png", with_google_fonts=False)


def create_app(settings: Settings | None = None, registry: Registry | None = None,
               timings_folder: str | None = None) -> AttendApp:
    """The app; its lifespan loads the repository, or it serves `registry` if given. `timings_folder`: the
    start's folder its processes share (the graphs' times, model control's names unloaded)."""
    settings = settings or get_settings()
    app = AttendApp(
        title="attend",
        version="0.1.0",
        description="The attention mechanisms of Dive into Deep Learning (masked softmax, additive, scaled "
        "dot-product, multi-head and self-attention with sinusoidal positional encoding), served through "
        "ONNX Runtime.",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
    )
    # What the routes read: the core (readiness, the registry, model control, metrics) and the keys.
    app.state.settings = settings
    dataplane = app.state.dataplane = Dataplane(settings, Metrics(), registry, timings_folder)
    app.state.api_keys = settings.api_key_list()
    install_error_handlers(app)
    _offline_docs(app)
    page.install(app)  # GET /: the page of heatmaps, public like /docs (it asks for the key itself)
    # The inference routes: endpoints ahead of FastAPI (their own request ID, access log and CORS
    # headers); the route of attend.router only documents /attend. RequestContext skips them.
    app.state.attend = InferenceEndpoint(dataplane, AttendCodec(), settings)
    app.state.infer = InferenceEndpoint(dataplane, InferCodec(), settings, parse_path)
    app.inference = {"attend": app.state.attend, "v2": app.state.infer}
    app.include_router(attend.router)
    # Without keys there is nothing to check: no dependency at all on the request path.
    protected = [Depends(require_api_key)] if app.state.api_keys else []
    app.include_router(models.router, dependencies=protected)
    app.include_router(health.metrics_router, dependencies=protected)
    app.include_router(health.router)
    app.include_router(v2.router, dependencies=protected)
    app.include_router(v2.health_router)
    app.include_router(v2.repository_router, dependencies=[Depends(require_admin)])
    app.include_router(v2.shm_router)  # its own check (on, and the key): Dataplane.check_shared_memory
    app.include_router(v2.logging_router)  # its own checks: the API key to read, an admin's to change
    app.include_router(v2.trace_router)  # the same checks as logging's
    if settings.cors_origin_list():
        # The preflight, and CORS headers on every other route (the inference endpoints add their own).
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origin_list(), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Request-Timeout-Ms"],
                           expose_headers=["X-Request-ID", "Retry-After", "X-Model-Version", "traceresponse"])
    app.add_middleware(RequestContext)  # outermost: every response carries X-Request-ID
    return app


def error_response(request: Request, error: ServiceError) -> Response:
    """The error in the body of the request's protocol (service.http.endpoint.error_body)."""
    return Response(error_body(request.url.path, error), status_code=error.status, media_type="application/json",
                    headers=error.headers)


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or str(loc[-1] if loc else "")


# The web framework's own refusals, in the one error table (service.core.errors).
_HTTP_ERRORS: dict[int, type[ServiceError]] = {404: RouteNotFound, 405: MethodNotAllowed}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        return error_response(request, InvalidRequest(first["msg"], field=_field_of(tuple(first["loc"]))))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = _HTTP_ERRORS.get(exc.status_code, HTTPError)
        error = kind(str(exc.detail), headers=getattr(exc, "headers", None))
        error.status = exc.status_code
        return error_response(request, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # Logged with its traceback here; the client gets a plain 500, never the traceback.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, ServiceError("internal server error"))


async def require_api_key(request: Request) -> None:
    """The same check as a FastAPI dependency (async: a plain `def` one would cost a thread hop)."""
    keys: tuple[bytes, ...] = request.app.state.api_keys
    if keys:
        check_api_key(request.headers.get("authorization", "").encode("latin-1"), keys)


async def require_admin(request: Request) -> None:
    """Model control: the core's check (service.core.dataplane.Dataplane.check_admin), as gRPC's."""
    request.app.state.dataplane.check_admin(request.headers.get("authorization", "").encode("latin-1"))
