"""Models that change while serving: load a version, swap it in, retire the old one; unload; reload
what changed in the repository (SIGHUP, or a poll). No HTTP here (service/routes/repository.py).

A load reads config.json and the model, checks it exactly as start-up does (sha256, signature) and
warms it up, in a thread, beside the versions serving; then `Registry.install` swaps it in with one
assignment. Requests already queued or running on the old version finish on it (its batcher drains,
then stops). A load that fails leaves what was serving as it was, and says why.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass

import anyio

from export.repository import NAME_RULE, valid_name
from service.core.batching import Scheduler
from service.core.errors import ModelNotFound, ServiceError, excerpt
from service.core.runtime import LoadedModel, Registry, StartupError

log = logging.getLogger("service")


class LoadFailed(ServiceError):
    """The model could not be loaded; what was serving still is."""

    status, code = 400, "load_failed"
    advice = ("The message says why (a missing or corrupt file, a wrong sha256 or signature): fix the version in "
              "the repository (python -m export), then load again.")


def _check_name(name: str) -> None:
    """Names from URLs follow the exporter's rule (a model's folder name), before they are near a path."""
    if not valid_name(name):
        raise InvalidName(f"{excerpt(name)} is not a model's name: a name is {NAME_RULE}", field="name")


class InvalidName(ServiceError):
    """A model-control URL names no model a repository could hold."""

    status, code = 400, "invalid_name"
    advice = f"Name the model as its folder in the repository is named: {NAME_RULE}."


@dataclass
class ModelControl:
    registry: Registry
    scheduler: Scheduler
    keep_versions: int = 1  # how many versions of a model stay loaded
    drain_s: float = 30.0  # how long a retired version may take to finish what it holds

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()  # one load or unload at a time: each sees the last one's result

    async def load(self, name: str) -> LoadedModel:
        """Load the newest version of `name` (a model already served, or a new one) and serve it."""
        loader = self.registry.loader
        if loader is None:
            raise LoadFailed("this service has no model repository to load from")
        _check_name(name)
        async with self._lock:
            newest = loader.newest(name)
            current = self.registry.get(name)
            if current is not None and current.config.version == newest:
                return current  # already serving it: nothing to swap
            try:
                model = await anyio.to_thread.run_sync(loader.load, name)
            except StartupError as e:
                self.registry.failed[(name, newest or 0)] = str(e)
                log.error("load of model %s failed, %s: %s", name,
                          f"version {current.config.version} still serving" if current else "not served", e)
                raise LoadFailed(str(e)) from None
            retired = self.registry.install(model, self.keep_versions)
            self.scheduler.batcher_for(model)
            log.info("model %s: version %d serving%s", name, model.config.version,
                     f"; version(s) {', '.join(str(m.config.version) for m in retired)} retired" if retired else "")
        if retired:
            gc.unfreeze()  # (service.http.server froze what was there at start: the retired snapshot too)
        for old in retired:
            self.scheduler.spawn(self.scheduler.retire(old, self.drain_s))
        return model

    async def unload(self, name: str) -> int:
        """Stop serving `name`: new requests for it get 404 at once; what its queue holds finishes
        first. Returns the number of versions unloaded."""
        _check_name(name)
        async with self._lock:
            if not self.registry.loaded_versions(name):
                raise ModelNotFound(f"model {excerpt(name)} is not loaded")
            retired = self.registry.remove(name)
        gc.unfreeze()
        drained = await asyncio.gather(*(self.scheduler.retire(m, self.drain_s) for m in retired))
        log.info("model %s unloaded%s", name, "" if all(drained) else " (its queue did not drain in time)")
        return len(retired)

    async def reload_changed(self) -> list[str]:
        """Load every model of the repository whose newest version is not the one served (new models
        included); a failure is logged and leaves that model as it was. Returns the models loaded."""
        loader = self.registry.loader
        if loader is None or not loader.repository.is_dir():
            return []
        from export.repository import list_models

        loaded = []
        for model_dir in list_models(loader.repository):
            name = model_dir.name
            newest = loader.newest(name)
            current = self.registry.get(name)
            if newest is None or (current is not None and current.config.version == newest):
                continue
            if (name, newest) in self.registry.failed:
                continue  # it failed already; a new export (a new version) will be tried
            try:
                await self.load(name)
                loaded.append(name)
            except ServiceError:
                pass  # logged by load
        return loaded

    async def poll(self, every_s: float) -> None:
        """Reload what changed every `every_s` seconds (ATTEND_POLL_S), for as long as the app serves."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reload_changed()
            except Exception:
                log.exception("polling the model repository failed")
