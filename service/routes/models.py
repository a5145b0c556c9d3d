"""GET /models and GET /models/{name}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.errors import ModelNotFound
from service.schemas import error_responses

router = APIRouter()


@router.get("/models", responses=error_responses(401, 422),
            summary="Every model: kind, hyperparameters, feature sizes, axes, provider, version")
async def list_models(request: Request) -> dict[str, Any]:
    registry = request.app.state.registry
    ready = [registry.get(name).describe() | {"status": "ready"} for name in registry.names()]
    broken = [{"name": name, "status": "unavailable", "reason": reason}
              for name, reason in sorted(registry.broken.items())]
    return {"models": ready + broken}


@router.get("/models/{name}", responses=error_responses(401, 404, 422), summary="One model")
async def get_model(request: Request, name: str) -> dict[str, Any]:
    registry = request.app.state.registry
    model = registry.get(name)
    if model is None and name in registry.broken:
        return {"name": name, "status": "unavailable", "reason": registry.broken[name]}
    if model is None:
        raise ModelNotFound(f"unknown model {name!r}; available: {', '.join(registry.names())}", field="name")
    return model.describe() | {"status": "ready"}
