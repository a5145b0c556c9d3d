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
    GET  /v2/logging, POST /v2/logging          Triton's log settings (the POST an admin call: service.core.logs)
    GET  /v2/systemsharedmemory[/region/{r}]/status, POST .../region/{r}/register, POST [.../region/{r}]/unregister
                                               Triton's system shared memory, where it is on (service.core.shm)
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.core.control import check_parameters
from service.core.errors import CONTROL_BODY_BYTES, ServiceError
from service.core.keys import check_api_key
from service.core.logs import log_settings
from service.core.request import find_model
from service.core.shm import Regions
from service.http.extensions import read_body
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


async def _control_body(request: Request) -> bytes:
    """A control call's body (the index, a region, a load's parameters, the log or trace settings), refused
    with 413 past CONTROL_BODY_BYTES as it comes: Starlette's `request.body()` reads any size."""
    limit = min(CONTROL_BODY_BYTES, request.app.state.settings.max_body_bytes)
    return await read_body(request.receive, dict(request.scope["headers"]), limit, named="a control call's limit")


@router.get("", summary="Server metadata", responses=protocol_errors(401))
async def server_metadata(request: Request) -> Response:
    # The repository routes are on where there are admin keys or model control (require_admin).
    dataplane = request.app.state.dataplane
    return _json({"name": "attend", "version": request.app.version,
                  "extensions": extensions(dataplane.model_control, dataplane.regions is not None)})


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


@repository_router.post("/index", responses=protocol_errors(400, 401, 404, 413, 422),
             summary="Every model of the repository folder, each version with its state")
async def index(request: Request) -> Response:
    raw = await _control_body(request)
    rows = await asyncio.to_thread(request.app.state.dataplane.registry.index)  # reads the disk: never on the loop
    if raw.strip():
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict) and body.get("ready") is True:
            rows = [r for r in rows if r["state"] == "READY"]
    return _json(rows)


@repository_router.post("/models/{name}/load", responses=protocol_errors(400, 401, 404, 413, 422),
             summary="Load the model's newest version (checked and warmed up), then serve it")
async def load(request: Request, name: str) -> Response:
    check_parameters(await _parameters(request))
    await request.app.state.dataplane.control.load(name)
    return _json({})


@repository_router.post("/models/{name}/unload", responses=protocol_errors(400, 401, 404, 413, 422),
             summary="Stop serving the model once what its queue holds has finished")
async def unload(request: Request, name: str) -> Response:
    check_parameters(await _parameters(request), unload=True)
    await request.app.state.dataplane.control.unload(name)
    return _json({})


async def _parameters(request: Request) -> dict[str, Any]:
    """A load's or unload's `parameters` (Triton's body: {"parameters": {...}}, or none)."""
    raw = await _control_body(request)
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the request is not valid JSON: {e.msg}") from None
    parameters = body.get("parameters") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not isinstance(parameters, dict | None):
        raise BadRequest("the request must be a JSON object, its parameters an object: {\"parameters\": {}}")
    return parameters or {}


class RegisterRegion(BaseModel):
    """A region of an object in /dev/shm (Triton's system shared memory register request)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    key: str = Field(max_length=256)
    offset: int = Field(0, ge=0)
    byte_size: int = Field(gt=0)


async def require_shared_memory(request: Request) -> None:
    """On, and the key (service.core.dataplane.Dataplane.check_shared_memory): before the body is read."""
    request.app.state.dataplane.check_shared_memory(request.headers.get("authorization", "").encode("latin-1"))


def _regions(request: Request) -> Regions:
    # Its calls go to a thread: with workers they lock and write the file the workers share.
    return request.app.state.dataplane.regions


shm_router = APIRouter(prefix="/v2/systemsharedmemory", tags=["Open Inference Protocol: system shared memory"],
                       dependencies=[Depends(require_shared_memory)])


# One function a route: a path parameter shared with a route that has none is a query parameter there.
@shm_router.get("/status", summary="Every registered region", responses=protocol_errors(401, 404))
async def shm_status_all(request: Request) -> Response:
    return _json(await asyncio.to_thread(_regions(request).status, ""))


@shm_router.get("/region/{name}/status", summary="One registered region", responses=protocol_errors(401, 404))
async def shm_status(request: Request, name: str) -> Response:
    return _json(await asyncio.to_thread(_regions(request).status, name))


@shm_router.post("/region/{name}/register", summary="Register a region of an object in /dev/shm",
                 responses=protocol_errors(400, 401, 404, 413, 422))
async def shm_register(request: Request, name: str) -> Response:
    # Read here, not as a FastAPI body: tritonclient sends it without a Content-Type.
    try:
        body = RegisterRegion.model_validate_json(await _control_body(request))
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"the register request{f' {field}' if field else ''}: {first['msg']} (send "
                         '{"key": "/name", "offset": 0, "byte_size": N})', field=field or None) from None
    await asyncio.to_thread(_regions(request).register, name, body.key, body.offset, body.byte_size)
    return _json({})


@shm_router.post("/unregister", summary="Unregister every region", responses=protocol_errors(401, 404))
async def shm_unregister_all(request: Request) -> Response:
    await asyncio.to_thread(_regions(request).unregister, "")
    return _json({})


@shm_router.post("/region/{name}/unregister", summary="Unregister one region", responses=protocol_errors(401, 404))
async def shm_unregister(request: Request, name: str) -> Response:
    await asyncio.to_thread(_regions(request).unregister, name)
    return _json({})


logging_router = APIRouter(prefix="/v2", tags=["Open Inference Protocol: logging"])  # its own checks


@logging_router.get("/logging", summary="Triton's log settings", responses=protocol_errors(401))
async def get_logging(request: Request) -> Response:
    keys = request.app.state.api_keys
    if keys:
        check_api_key(request.headers.get("authorization", "").encode("latin-1"), keys)
    return _json(log_settings())


@logging_router.post("/logging", summary="Change some of the log settings (an admin call, as model control)",
                     responses=protocol_errors(400, 401, 404, 413))
async def post_logging(request: Request) -> Response:
    dataplane = request.app.state.dataplane
    dataplane.check_admin(request.headers.get("authorization", "").encode("latin-1"), "changing the log settings")
    return _json(dataplane.update_log_settings(await _settings(request, "log")))


async def _settings(request: Request, kind: str) -> dict[str, Any]:
    """The body of a POST of the log or trace settings: a JSON object."""
    try:
        body = orjson.loads(await _control_body(request))
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the {kind} settings are not valid JSON: {e.msg}") from None
    if not isinstance(body, dict):
        example = '{"log_verbose_level": 1}' if kind == "log" else '{"trace_rate": "100"}'
        raise BadRequest(f"the {kind} settings must be a JSON object, e.g. {example}")
    return body


trace_router = APIRouter(prefix="/v2", tags=["Open Inference Protocol: trace"])  # its own checks, as logging's


@trace_router.get("/trace/setting", summary="Triton's trace settings", responses=protocol_errors(401))
async def get_trace_setting(request: Request) -> Response:
    return _trace_settings(request, None)


@trace_router.get("/models/{name}/trace/setting", summary="A model's trace settings",
                  responses=protocol_errors(401, 404))
async def get_model_trace_setting(request: Request, name: str) -> Response:
    return _trace_settings(request, name)


def _trace_settings(request: Request, name: str | None) -> Response:
    keys = request.app.state.api_keys
    if keys:
        check_api_key(request.headers.get("authorization", "").encode("latin-1"), keys)
    return _json(request.app.state.dataplane.get_trace_settings(name))


@trace_router.post("/trace/setting", summary="Change the trace settings (an admin call, as model control)",
                   responses=protocol_errors(400, 401, 404, 413))
async def post_trace_setting(request: Request) -> Response:
    return await _change_trace_settings(request, None)


@trace_router.post("/models/{name}/trace/setting", summary="Change a model's trace settings (null: the global one)",
                   responses=protocol_errors(400, 401, 404, 413))
async def post_model_trace_setting(request: Request, name: str) -> Response:
    return await _change_trace_settings(request, name)


async def _change_trace_settings(request: Request, name: str | None) -> Response:
    dataplane = request.app.state.dataplane
    dataplane.check_admin(request.headers.get("authorization", "").encode("latin-1"), "changing the trace settings")
    return _json(dataplane.update_trace_settings(name, await _settings(request, "trace")))
