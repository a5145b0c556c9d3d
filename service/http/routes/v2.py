"""The Open Inference Protocol's routes but inference (service.protocols.v2 is its codec): server and
model metadata, health, Triton's model configuration, and the model repository extension (the
index of the repository folder, load and unload while serving; service.core.control does the work;
admin operations: see service.http.app.require_admin).

    GET  /v2                                   server metadata (extensions: binary_tensor_data, statistics,
                                               and model_repository where model control is on)
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{m}[/versions/{v}]         model metadata: inputs and outputs, -1 for dynamic axes
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config  Triton's model configuration (perf_analyzer reads it)
    GET  /v2/models[/{m}[/versions/{v}]]/stats Triton's statistics extension (service.core.statistics)
    POST /v2/repository/index, /v2/repository/models/{m}/load|unload
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.core.errors import ServiceError
from service.core.request import find_model
from service.http.schemas import protocol_errors
from service.protocols.v2 import (
    BadRequest,
    config,
    extensions,
    metadata,
)

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])


health_router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])  # open: no API key


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@router.get("", summary="Server metadata", responses=protocol_errors(401))
async def server_metadata(request: Request) -> Response:
    # The repository routes are on where there are admin keys or model control (require_admin).
    on = request.app.state.dataplane.model_control
    return _json({"name": "attend", "version": request.app.version, "extensions": extensions(on)})


@health_router.get("/health/live", summary="The process is up")
async def live() -> Response:
    return _json({"live": True})


@health_router.get("/health/ready", summary="Every model is loaded and warmed up", responses=protocol_errors(503))
async def ready(request: Request) -> Response:
    request.app.state.dataplane.check_ready()
    return _json({"ready": True})


# Before /models/{name}: "stats" is not a model's name here (as in Triton).
@router.get("/models/stats", summary="Statistics of every loaded version of every model (Triton's extension)",
            responses=protocol_errors(401))
async def all_statistics(request: Request) -> Response:
    # Its own handler: with model_statistics', `name` and `version` would be query parameters here.
    return _json(request.app.state.dataplane.statistics())


@router.get("/models/{name}/stats", summary="Statistics of every loaded version of the model",
            responses=protocol_errors(401, 404, 422, 503))
@router.get("/models/{name}/versions/{version}/stats", summary="Statistics of one version of the model",
            responses=protocol_errors(401, 404, 422, 503))
async def model_statistics(request: Request, name: str, version: str | None = None) -> Response:
    return _json(request.app.state.dataplane.statistics(name, version))


@router.get("/models/{name}", summary="Model metadata", responses=protocol_errors(401, 404, 422, 503))
@router.get("/models/{name}/versions/{version}", summary="Model metadata of one version",
            responses=protocol_errors(401, 404, 422, 503))
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    return _json(metadata(find_model(request.app.state.dataplane.registry, name, version)))


@router.get("/models/{name}/ready", summary="The model is ready (200) or not (400)",
            responses=protocol_errors(400, 401, 422))
@router.get("/models/{name}/versions/{version}/ready", summary="The version is ready (200) or not (400)",
            responses=protocol_errors(400, 401, 422))
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    try:
        find_model(request.app.state.dataplane.registry, name, version)
    except ServiceError as e:
        raise BadRequest(e.message) from None
    if not request.app.state.dataplane.ready:
        raise BadRequest(f"model {name} is not ready: the service is not ready")
    return _json({"name": name, "ready": True})


@router.get("/models/{name}/config", summary="Triton's model configuration",
            responses=protocol_errors(401, 404, 422, 503))
@router.get("/models/{name}/versions/{version}/config", summary="Triton's model configuration of one version",
            responses=protocol_errors(401, 404, 422, 503))
async def model_config(request: Request, name: str, version: str | None = None) -> Response:
    settings = request.app.state.settings
    return _json(config(find_model(request.app.state.dataplane.registry, name, version), settings.max_batch))


repository_router = APIRouter(prefix="/v2/repository", tags=["Open Inference Protocol: model repository"])


@repository_router.post("/index", responses=protocol_errors(400, 401, 404, 422),
             summary="Every model of the repository folder, each version with its state")
async def index(request: Request) -> Response:
    rows = request.app.state.dataplane.registry.index()
    raw = await request.body()
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict) and body.get("ready") is True:
            rows = [r for r in rows if r["state"] == "READY"]
    return _json(rows)


@repository_router.post("/models/{name}/load", responses=protocol_errors(400, 401, 404, 422),
             summary="Load the model's newest version (checked and warmed up), then serve it")
async def load(request: Request, name: str) -> Response:
    await request.app.state.dataplane.control.load(name)
    return _json({})


@repository_router.post("/models/{name}/unload", responses=protocol_errors(400, 401, 404, 422),
             summary="Stop serving the model once what its queue holds has finished")
async def unload(request: Request, name: str) -> Response:
    await request.app.state.dataplane.control.unload(name)
    return _json({})
