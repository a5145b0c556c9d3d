"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.errors import NotReady
from service.schemas import error_responses

router = APIRouter()
metrics_router = APIRouter()  # behind the API keys, when there are any


@router.get("/health/live", summary="The process is up")
async def live() -> dict[str, str]:
    return {"status": "alive"}


def check_ready(state: object) -> None:
    """Ready: started, not stopping, and every model that should be served is (one that could not
    be loaded at start, kept out by ATTEND_SKIP_BROKEN_MODELS, is not; one unloaded on purpose does
    not count). Raises NotReady saying why."""
    if not state.ready:  # type: ignore[attr-defined]
        raise NotReady("not ready", headers={"Retry-After": "1"})
    broken = state.registry.broken  # type: ignore[attr-defined]
    if broken:
        raise NotReady(f"not ready: model(s) {', '.join(sorted(broken))} could not be loaded (GET /models says why)")


@router.get("/health/ready", responses=error_responses(503),
            summary="Every model is loaded and warmed up (503 until then, while one is missing, and while stopping)")
async def ready(request: Request) -> dict[str, object]:
    state = request.app.state
    check_ready(state)
    return {"status": "ready", "models": state.registry.names()}


@metrics_router.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401),
                    summary="Prometheus metrics (text format)")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
