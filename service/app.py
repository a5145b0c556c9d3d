"""`create_app(settings)`: the FastAPI app, wired in named steps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import fastapi_offline
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from service.auth import require_admin, require_api_key
from service.batching import Scheduler
from service.config import Settings, get_settings
from service.control import ModelControl
from service.dataplane import Dataplane
from service.errors import install_error_handlers
from service.metrics import MULTIPROCESS, Metrics
from service.middleware import RequestContext, configure_logging, flush_logs
from service.routes import attend, health, models, page, repository, v2
from service.runtime import Registry
from service.server import release_memory_eagerly, trim_memory

log = logging.getLogger("service")

# Swagger UI's and ReDoc's JavaScript and CSS, bundled by the fastapi-offline package: /docs and
# /redoc work on a machine without internet (FastAPI's defaults load them from a CDN).
_DOCS_ASSETS = Path(fastapi_offline.__file__).parent / "static"
_ASSETS_URL = "/docs-assets"


class AttendApp(FastAPI):
    """FastAPI, with the inference routes (POST /attend, POST /v2/models/.../infer) handed to their
    endpoints before FastAPI's own request handling (routing, exception middleware, telemetry
    hooks): ~45 us a request that the book's toy request (~20 us of attention) would otherwise pay.
    Everything else goes through FastAPI as usual."""

    fast_attend: ASGIApp | None = None
    fast_infer: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fast_attend is not None and scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == "/attend":
                return await self.fast_attend(scope, receive, send)
            if v2.is_infer(path):
                return await self.fast_infer(scope, receive, send)  # type: ignore[misc]
        await super().__call__(scope, receive, send)


def load_registry(settings: Settings) -> Registry:
    return Registry.load(settings.model_repository, settings.device, settings.resolved_intra_op_threads(),
                         settings.cuda_tf32, settings.warmup, settings.skip_broken_models)


def _lifespan(settings: Settings, preloaded: Registry | None):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Sessions are created (and warmed up) here, once, never at import time, unless the
        # caller loaded them already (python -m service does, to fail fast with one line).
        registry = preloaded or await anyio.to_thread.run_sync(load_registry, settings)
        app.state.registry = registry
        scheduler = Scheduler([registry.get(n) for n in registry.names()], settings.batch_limits(),
                              settings.resolved_inference_threads(), app.state.metrics)
        scheduler.start()
        app.state.scheduler = scheduler
        app.state.dataplane = Dataplane(registry, app.state.metrics, settings.request_limits(), scheduler,
                                        settings.resolved_inference_threads(), settings.inline_decode_bytes)
        app.state.control = ModelControl(registry, scheduler, settings.keep_versions, settings.grace_period_s)
        if settings.poll_s:
            scheduler.spawn(app.state.control.poll(settings.poll_s))
        if not MULTIPROCESS:  # read at scrape time; in multiprocess mode the endpoints count it themselves
            app.state.metrics.in_flight.set_function(lambda: app.state.dataplane.in_flight)
        scheduler.spawn(_trim_memory_when_idle(app.state.dataplane))
        app.state.attend.dataplane = app.state.infer.dataplane = app.state.dataplane
        app.state.serving = True  # stays on while draining: what reaches a handler then was sent before
        app.state.ready = True
        app.state.metrics.ready.set(1)
        log.info("ready: %d models from %s", len(registry.names()), settings.model_repository)
        try:
            yield
        finally:
            app.state.ready = app.state.serving = False
            app.state.metrics.ready.set(0)
            await scheduler.stop()
            app.state.attend.dataplane = app.state.infer.dataplane = None
            app.state.dataplane.close()
            app.state.metrics.worker_exit()
            flush_logs()

    return lifespan


async def _trim_memory_when_idle(dataplane: Dataplane, every_s: float = 2.0) -> None:
    """After requests, once a whole period passed with none arriving and none in flight, give freed
    heap memory back to the system (glibc keeps it otherwise: 400-800 MB stayed resident after a
    burst of large bodies). Not under steady load: the next requests would fault the pages in again."""
    seen = 0
    while True:
        await asyncio.sleep(every_s)
        served = dataplane.served_since_trim
        if served and served == seen and not dataplane.in_flight:
            await anyio.to_thread.run_sync(trim_memory)
            dataplane.served_since_trim = served = 0
        seen = served


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


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> AttendApp:
    """The app; it loads the repository in its lifespan, or serves `registry` if given."""
    settings = settings or get_settings()
    app = AttendApp(
        title="attend",
        version="0.1.0",
        description="The attention mechanisms of Dive into Deep Learning (masked softmax, additive, scaled "
        "dot-product, multi-head and self-attention with sinusoidal positional encoding), served through "
        "ONNX Runtime.",
        lifespan=_lifespan(settings, registry),
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.ready = app.state.serving = False
    app.state.api_keys = settings.api_key_list()
    app.state.admin_keys = settings.admin_key_list()
    install_error_handlers(app)
    _offline_docs(app)
    page.install(app)  # GET /: the page of heatmaps, public like /docs (it asks for the key itself)
    endpoint = app.state.attend = attend.AttendEndpoint(app.state)
    infer = app.state.infer = v2.InferEndpoint(app.state)
    # The inference routes: the endpoints themselves (their own request ID and access log), ahead of
    # the route that documents /attend; RequestContext skips them.
    app.router.routes.append(Route("/attend", endpoint, methods=["POST"], include_in_schema=False))
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        app.router.routes.append(Route(path, infer, methods=["POST"], include_in_schema=False))
    app.include_router(attend.router)
    # Without keys there is nothing to check: no dependency at all on the request path.
    protected = [Depends(require_api_key)] if app.state.api_keys else []
    app.include_router(models.router, dependencies=protected)
    app.include_router(health.metrics_router, dependencies=protected)
    app.include_router(health.router)
    app.include_router(v2.router, dependencies=protected)
    app.include_router(v2.health_router)
    app.include_router(repository.router, dependencies=[Depends(require_admin)])
    if settings.cors_origin_list():
        # CORS headers come from the middleware: /attend goes through FastAPI's stack (and its route).
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origin_list(), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Request-Timeout-Ms"],
                           expose_headers=["X-Request-ID", "Retry-After"])
    else:
        app.fast_attend, app.fast_infer = endpoint, infer
    app.add_middleware(RequestContext)  # outermost: every response carries X-Request-ID
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn's factory for worker processes: settings from the environment."""
    settings = get_settings()
    configure_logging(settings.log_level)  # a worker is a new process: the parent's handlers are not there
    release_memory_eagerly()
    return create_app(settings)
