"""`create_app(settings)`: the FastAPI app, wired in named steps."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from service.auth import require_api_key
from service.batching import Scheduler
from service.config import Settings, get_settings
from service.dataplane import Dataplane
from service.errors import install_error_handlers
from service.metrics import Metrics
from service.middleware import RequestContext, configure_logging
from service.routes import attend, health, models
from service.runtime import Registry

log = logging.getLogger("service")


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
        app.state.dataplane = Dataplane(registry, app.state.metrics, settings.request_limits())
        app.state.limiter = anyio.CapacityLimiter(settings.resolved_inference_threads())
        scheduler = Scheduler([registry.get(n) for n in registry.names()], settings.batch_limits(),
                              settings.resolved_inference_threads(), app.state.metrics)
        scheduler.start()
        app.state.scheduler = scheduler
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

    return lifespan


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> FastAPI:
    """The app; it loads the repository in its lifespan, or serves `registry` if given."""
    settings = settings or get_settings()
    # FastAPIOffline: /docs and /redoc with Swagger UI's and ReDoc's assets served from the package,
    # not from a CDN, so they work without internet.
    app = FastAPIOffline(
        title="attend",
        version="0.1.0",
        description="The attention mechanisms of Dive into Deep Learning (masked softmax, additive, scaled "
        "dot-product, multi-head and self-attention with sinusoidal positional encoding), served through "
        "ONNX Runtime.",
        lifespan=_lifespan(settings, registry),
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.ready = app.state.serving = False
    app.state.api_keys = settings.api_key_list()
    install_error_handlers(app)
    # Without keys there is nothing to check: no dependency at all on the request path.
    protected = [Depends(require_api_key)] if app.state.api_keys else []
    app.include_router(attend.router, dependencies=protected)
    app.include_router(models.router, dependencies=protected)
    app.include_router(health.metrics_router, dependencies=protected)
    app.include_router(health.router)
    if settings.cors_origin_list():
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origin_list(), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Request-Timeout-Ms"],
                           expose_headers=["X-Request-ID", "Retry-After"])
    app.add_middleware(RequestContext)  # outermost: every response carries X-Request-ID
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn's factory for worker processes: settings from the environment."""
    settings = get_settings()
    configure_logging(settings.log_level)  # a worker is a new process: the parent's handlers are not there
    return create_app(settings)
