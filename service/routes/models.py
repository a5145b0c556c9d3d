"""GET /models and GET /models/{name}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.errors import ModelNotFound

router = APIRouter()


@router.get("/models", summary="Every model: kind, hyperparameters, feature sizes, axes, provider, version")
async def list_models(request: Request) -> dict[str, Any]:
    registry = request.app.state.registry
    return {"models": [registry.get(name).describe() for name in registry.names()]}


@router.get("/models/{name}", summary="One model")
async def get_model(request: Request, name: str) -> dict[str, Any]:
    registry = request.app.state.registry
    model = registry.get(name)
    if model is None:
        raise ModelNotFound(f"unknown model {name!r}; available: {', '.join(registry.names())}", field="name")
    return model.describe()
