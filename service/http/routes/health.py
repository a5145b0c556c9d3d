"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.http.schemas import error_responses

router = APIRouter()
metrics_router = APIRouter()  # behind the API keys, when there are any


@router.get("/health/live", summary="The process is up")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/health/ready", responses=error_responses(503),
            summary="Every model is loaded and warmed up (503 until then, while one is missing, and while stopping)")
async def ready(request: Request) -> dict[str, object]:
    dataplane = request.app.state.dataplane
    dataplane.check_ready()
    return {"status": "ready", "models": dataplane.registry.names()}


@metrics_router.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401),
                    summary="Prometheus metrics (text format)")
async def metrics(request: Request) -> Response:
    # On a thread: a scrape reads /proc and, with workers, every worker's files, in Python that gives the GIL
    # up as it goes; the event loop serves meanwhile.
    body = await asyncio.to_thread(request.app.state.dataplane.metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
