"""The Open Inference Protocol's routes but inference (service.protocols.v2 is its codec): server and
model metadata, health, Triton's model configuration, and the model repository extension (the
index of the repository folder, load and unload while serving; service.core.control does the work;
admin operations: see service.http.app.require_admin).

    GET  /v2                                   server metadata (extensions: binary_tensor_data, and
                                               model_repository where model control is on)
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{m}[/versions/{v}]         model metadata: inputs and outputs, -1 for dynamic axes
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config  Triton's model configuration (perf_analyzer reads it)
    POST /v2/repository/index, /v2/repository/models/{m}/load|unload
"""

from __future__ import annotations

from typing import Any

import orjson
import simdjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import Scope

from service.core.batching import Encoder
from service.core.dataplane import check_ready
from service.core.errors import ServiceError, UnsupportedMediaType, excerpt, json_type
from service.core.request import Request as Inference
from service.core.request import _model, build_request
from service.core.runtime import LoadedModel
from service.http.endpoint import JSON, Headers, InferenceEndpoint, media_type
from service.http.schemas import protocol_errors
from service.protocols.v2 import (
    OCTETS,
    BadRequest,
    _decompress,
    _encoder,
    _flag,
    _Reader,
    _requested,
    _tensor,
    config,
    error_json,
    metadata,
    parse_path,
)

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])


health_router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])  # open: no API key


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@router.get("", summary="Server metadata", responses=protocol_errors(401))
async def server_metadata(request: Request) -> Response:
    state = request.app.state
    extensions = ["binary_tensor_data"]
    if state.admin_keys or state.settings.model_control:  # the repository routes are on (require_admin)
        extensions.append("model_repository")
    return _json({"name": "attend", "version": request.app.version, "extensions": extensions})


@health_router.get("/health/live", summary="The process is up")
async def live() -> Response:
    return _json({"live": True})


@health_router.get("/health/ready", summary="Every model is loaded and warmed up", responses=protocol_errors(503))
async def ready(request: Request) -> Response:
    check_ready(request.app.state)
    return _json({"ready": True})


@router.get("/models/{name}", summary="Model metadata", responses=protocol_errors(401, 404, 422, 503))
@router.get("/models/{name}/versions/{version}", summary="Model metadata of one version",
            responses=protocol_errors(401, 404, 422, 503))
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    return _json(metadata(_model(request.app.state.registry, name, version)))


@router.get("/models/{name}/ready", summary="The model is ready (200) or not (400)",
            responses=protocol_errors(400, 401, 422))
@router.get("/models/{name}/versions/{version}/ready", summary="The version is ready (200) or not (400)",
            responses=protocol_errors(400, 401, 422))
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    try:
        _model(request.app.state.registry, name, version)
    except ServiceError as e:
        raise BadRequest(e.message) from None
    if not request.app.state.ready:
        raise BadRequest(f"model {name} is not ready: the service is not ready")
    return _json({"name": name, "ready": True})


@router.get("/models/{name}/config", summary="Triton's model configuration",
            responses=protocol_errors(401, 404, 422, 503))
@router.get("/models/{name}/versions/{version}/config", summary="Triton's model configuration of one version",
            responses=protocol_errors(401, 404, 422, 503))
async def model_config(request: Request, name: str, version: str | None = None) -> Response:
    settings = request.app.state.settings
    return _json(config(_model(request.app.state.registry, name, version), settings.max_batch))


class InferEndpoint(InferenceEndpoint):
    """POST /v2/models/{m}[/versions/{v}]/infer."""

    def model_of(self, scope: Scope) -> str:
        # A label only for models that exist: a client's made-up names must not grow the metrics.
        try:
            name, _ = parse_path(scope["path"])
        except ServiceError:
            return "-"
        return name if self.dataplane is not None and self.dataplane.registry.get(name) is not None else "-"

    def aligned_at(self, headers: dict[bytes, bytes]) -> int:
        # The binary tensors start after the JSON header: read in place where they are aligned.
        length = headers.get(b"inference-header-content-length")
        return int(length) if length is not None and length.isdigit() else 0

    def check_media_type(self, headers: dict[bytes, bytes]) -> None:
        # tritonclient's sync client sends no Content-Type at all; its aio client application/octet-stream.
        media = media_type(headers)
        if media not in (None, "", "application/json", "application/octet-stream") and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json or application/octet-stream, "
                                       f"got {media[:100]}")

    async def decode(self, scope: Scope, headers: dict[bytes, bytes], body: bytes | memoryview,
                     until: float) -> tuple[Inference, Encoder]:
        name, version = parse_path(scope["path"])
        model = _model(self.dataplane.registry, name, version)

        def decode(raw: bytes) -> tuple[Inference, Encoder]:
            try:
                return self._decode(model, headers, raw)
            except ServiceError as e:
                e.model = model.name
                raise

        return await self.dataplane.decode_async(decode, body, until)

    def _decode(self, model: LoadedModel, headers: dict[bytes, bytes], body: bytes) -> tuple[Inference, Encoder]:
        body = _decompress(body, headers.get(b"content-encoding"), self.settings.max_body_bytes)
        header_length = headers.get(b"inference-header-content-length")
        if header_length is None:
            split = len(body)
        else:
            if not header_length.isdigit() or not 0 < int(header_length) <= len(body):
                raise BadRequest(f"Inference-Header-Content-Length must be between 1 and the body's {len(body)} "
                                 f"bytes, got {excerpt(header_length.decode('latin-1'))}")
            split = int(header_length)
        try:
            request = simdjson.Parser().parse(body[:split] if split < len(body) else body)
        except (ValueError, RuntimeError, UnicodeDecodeError):
            try:
                request = orjson.loads(body[:split])
            except orjson.JSONDecodeError as e:
                raise BadRequest(f"the inference request is not valid JSON: {e.msg} (line {e.lineno} column "
                                 f"{e.colno})") from None
        if not isinstance(request, simdjson.Object | dict):
            raise BadRequest(f"the inference request must be a JSON object, got {json_type(request)}")
        request_id = request.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise BadRequest(f"id must be a string, got {json_type(request_id)}")
        parameters = request.get("parameters")
        if isinstance(parameters, simdjson.Object):
            parameters = parameters.as_dict()
        inputs = request.get("inputs")
        if not isinstance(inputs, simdjson.Array | list):
            raise BadRequest(f"inputs must be a list of tensors, got {json_type(inputs)}")
        reader, seen, tensors = _Reader(memoryview(body)[split:]), set(), {}
        for entry in inputs:
            if isinstance(entry, simdjson.Object):  # all but the data as plain values: they are small
                entry = {k: v if k == "data" else v.as_list() if isinstance(v, simdjson.Array)
                         else v.as_dict() if isinstance(v, simdjson.Object) else v for k, v in entry.items()}
            name, array = _tensor(entry, model, reader, seen)
            tensors[name] = array
        reader.done()
        missing = [s.name for s in model.inputs() if s.name not in tensors and s.name != "valid_lens"]
        if missing:
            raise BadRequest(f"model {model.name} needs input(s) {', '.join(missing)}")
        outputs = request.get("outputs")
        if isinstance(outputs, simdjson.Array):
            outputs = outputs.as_list()
        wanted = _requested(outputs, model, _flag(parameters, "binary_data_output"))
        lens = tensors.pop("valid_lens", None)
        try:
            inference = build_request(model, tensors, lens, any(n == "attention_weights" for n, _ in wanted),
                                      self.dataplane.limits)
        except ServiceError as e:  # /attend's checks, said the protocol's way: which input
            if e.field in model.input_names and not e.message.startswith("input "):
                e.message = f"input {e.field}: {e.message}"
            raise
        return inference, _encoder(model, wanted, request_id)

    def response(self, content: tuple[bytes | list, int | None]) -> tuple[bytes | list, Headers, bytes]:
        body, header_length = content
        if header_length is None:
            return body, [], JSON
        return body, [(b"inference-header-content-length", str(header_length).encode())], OCTETS

    def error_body(self, error: ServiceError) -> bytes:
        return error_json(error)


repository_router = APIRouter(prefix="/v2/repository", tags=["Open Inference Protocol: model repository"])


@repository_router.post("/index", responses=protocol_errors(400, 401, 404, 422),
             summary="Every model of the repository folder, each version with its state")
async def index(request: Request) -> Response:
    rows = request.app.state.registry.index()
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
    await request.app.state.control.load(name)
    return _json({})


@repository_router.post("/models/{name}/unload", responses=protocol_errors(400, 401, 404, 422),
             summary="Stop serving the model once what its queue holds has finished")
async def unload(request: Request, name: str) -> Response:
    await request.app.state.control.unload(name)
    return _json({})
