"""Triton's model repository extension: the index of the repository folder, load and unload, while
serving (service.control does the work). Admin operations: see service.auth.require_admin."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.schemas import protocol_errors

router = APIRouter(prefix="/v2/repository", tags=["Open Inference Protocol: model repository"])


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


@router.post("/index", responses=protocol_errors(400, 401, 404, 422),
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


@router.post("/models/{name}/load", responses=protocol_errors(400, 401, 404, 422),
             summary="Load the model's newest version (checked and warmed up), then serve it")
async def load(request: Request, name: str) -> Response:
    await request.app.state.control.load(name)
    return _json({})


@router.post("/models/{name}/unload", responses=protocol_errors(400, 401, 404, 422),
             summary="Stop serving the model once what its queue holds has finished")
async def unload(request: Request, name: str) -> Response:
    await request.app.state.control.unload(name)
    return _json({})
