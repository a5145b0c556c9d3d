"""GET /models and GET /models/{name}."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from service.core.request import unknown_model
from service.http.schemas import error_responses

router = APIRouter()


@router.get("/models", responses=error_responses(401, 422),
            summary="Every model: kind, hyperparameters, feature sizes, axes, provider, version")
async def list_models(request: Request) -> dict[str, Any]:
    registry = request.app.state.dataplane.registry
    rows = await repository_index(registry)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append(row)
    return {"models": [_describe(registry, name, by_name.get(name, [])) for name in _all_names(registry, rows)]}


async def repository_index(registry: Any) -> list[dict[str, Any]]:
    """The repository's models and versions (Registry.index), read once a request, on a thread: the disk is
    read (a network mount may be slow), and never on the event loop."""
    return await asyncio.to_thread(registry.index)


def _all_names(registry: Any, rows: list[dict[str, Any]]) -> list[str]:
    """Served, broken, and in the repository folder but not loaded."""
    return sorted({row["name"] for row in rows} | set(registry.names()) | set(registry.broken))


def _describe(registry: Any, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A model as GET /models shows it: served (with the version it serves and the versions loaded),
    unavailable (why), or not loaded; and the state of each version of the repository folder (`rows`: the
    index's, its own among them)."""
    versions = [{"version": r["version"], "state": r["state"] or "not loaded", **({"reason": r["reason"]}
                 if r["reason"] else {})} for r in rows if r["name"] == name and r["version"]]
    model = registry.get(name)
    if model is not None:
        return model.describe() | {"status": "ready", "loaded_versions": registry.loaded_versions(name),
                                   "repository_versions": versions}
    if name in registry.broken:
        return {"name": name, "status": "unavailable", "reason": registry.broken[name], "repository_versions": versions}
    return {"name": name, "status": "not loaded", "repository_versions": versions}


@router.get("/models/{name}", responses=error_responses(401, 404, 422), summary="One model")
async def get_model(request: Request, name: str) -> dict[str, Any]:
    registry = request.app.state.dataplane.registry
    rows = await repository_index(registry)
    if name not in _all_names(registry, rows):
        raise unknown_model(registry, name, "name")
    return _describe(registry, name, rows)
