"""Models that change while serving: load a version, swap it in, retire the old one; unload; reload
what changed in the repository (SIGHUP, or a poll). No HTTP here (service/routes/repository.py).

A load reads config.json and the model, checks it exactly as start-up does (sha256, signature) and
warms it up, in a thread, beside the versions serving; then `Registry.install` swaps it in with one
assignment. Requests already queued or running on the old version finish on it (its batcher drains,
then stops). A load that fails leaves what was serving as it was, and says why.

An unload holds until a load: SIGHUP and the poll skip the models unloaded (they brought them back). With
ATTEND_WORKERS > 1 a load or unload reaches one worker; it writes the names unloaded to a file the workers
share and sends SIGHUP to the supervisor, which passes it to every worker: each unloads those and loads
what changed, as the one that was called did.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from export.repository import NAME_RULE, valid_name
from service.core.batching import Scheduler
from service.core.errors import ModelNotFound, ServiceError, excerpt
from service.core.runtime import LoadedModel, Loader, Registry, Stamp, StartupError

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


class UnsupportedParameter(ServiceError):
    """A load or unload parameter the service does not take (Triton's config override and model files)."""

    status, code = 400, "unsupported_parameter"
    advice = ("Load without parameters: a model loads as its folder in the repository has it (python -m export "
              "writes it, config.json included). An unload takes unload_dependents only.")


def check_parameters(names: Iterable[str], unload: bool = False) -> None:
    """Refused rather than ignored: a client that sent a config or files would think them loaded. An unload's
    unload_dependents is taken (no model depends on another)."""
    for name in names:
        if not (unload and name == "unload_dependents"):
            what = "an unload takes only unload_dependents" if unload else \
                "a load takes no config or files: the model loads as its folder in the repository has it"
            raise UnsupportedParameter(f"parameter {excerpt(str(name))}: {what}", field="parameters")


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
    shared: Path | None = None  # with workers: the file of the names unloaded, which every worker follows
    notify: Callable[[], None] = lambda: None  # with workers: the others do the same (SIGHUP to the supervisor)
    counted: Callable[[str, str], None] = lambda name, result: None  # a load: (model, "loaded" or "failed")
    unloaded: set[str] = field(default_factory=set, init=False)  # unloaded here, and not loaded since

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()  # one load or unload at a time: each sees the last one's result
        self._repository_gone = False  # said once, not at every poll

    async def load(self, name: str, tell: bool = True) -> LoadedModel:
        """Load the newest version of `name` (a model already served, or a new one) and serve it; `tell`: and
        the other workers (not for SIGHUP and the poll, which reach each)."""
        loader = self.registry.loader
        if loader is None:
            raise LoadFailed("this service has no model repository to load from")
        _check_name(name)
        async with self._lock:
            # The repository is read on a thread: a slow or hung filesystem (a network mount) must not hold the loop.
            newest, on_disk = await anyio.to_thread.run_sync(lambda: (loader.newest(name), loader.stamp(name)))
            current = self.registry.get(name)
            if current is not None and current.stamp is not None and current.stamp == on_disk:
                # Already serving it, as it is on disk: nothing to swap, unless another worker unloaded it since.
                self._share(discard=name, tell=False)
                return current
            try:
                model = await anyio.to_thread.run_sync(loader.load, name)
            except StartupError as e:
                self.registry.failed[(name, newest or 0)] = str(e)
                if newest is not None:  # a model of the repository (not a name an admin mistyped)
                    self.counted(name, "failed")
                log.error("load of model %s failed, %s: %s", name,
                          f"version {current.config.version} still serving" if current else "not served", e)
                raise LoadFailed(str(e)) from None
            retired = self.registry.install(model, self.keep_versions)
            self.counted(name, "loaded")
            self.scheduler.batcher_for(model)
            log.info("model %s: version %d serving%s", name, model.config.version,
                     f"; version(s) {', '.join(str(m.config.version) for m in retired)} retired" if retired else "")
            self._share(discard=name, tell=tell)
        if retired:
            gc.unfreeze()  # (service.http.server froze what was there at start: the retired snapshot too)
        for old in retired:
            self.scheduler.spawn(self.scheduler.retire(old, self.drain_s))
        return model

    async def unload(self, name: str) -> int:
        """Stop serving `name` until it is loaded again: new requests for it get 404 at once; what its
        queue holds finishes first. Returns the number of versions unloaded."""
        _check_name(name)
        async with self._lock:
            if not self.registry.loaded_versions(name):
                raise ModelNotFound(f"model {excerpt(name)} is not loaded")
            retired = self.registry.remove(name)
            self._share(add=name)
        return await self._retire(name, retired)

    async def _retire(self, name: str, retired: list[LoadedModel]) -> int:
        gc.unfreeze()
        drained = await asyncio.gather(*(self.scheduler.retire(m, self.drain_s) for m in retired))
        log.info("model %s unloaded%s", name, "" if all(drained) else " (its queue did not drain in time)")
        return len(retired)

    def _share(self, add: str = "", discard: str = "", tell: bool = True) -> None:
        """The names unloaded, here and (with workers) in the file they share; `tell`: the other workers follow
        (a load's new version too), else only where the names changed."""
        if self.shared is None:
            self.unloaded = (self.unloaded | {add}) - {discard, ""}
            return
        with open(self.shared.with_suffix(".lock"), "a") as lock:  # two workers called at once: both kept
            fcntl.flock(lock, fcntl.LOCK_EX)
            before = _read_names(self.shared)
            names = (before | {add}) - {discard, ""}
            if names != before:
                temporary = self.shared.with_suffix(".tmp")
                temporary.write_text(json.dumps(sorted(names)))
                os.replace(temporary, self.shared)  # a reader sees the old list or the new, whole
        self.unloaded = names
        if tell or names != before:
            self.notify()

    async def follow(self) -> None:
        """With workers: unload here what was unloaded through another worker (the shared file's names)."""
        if self.shared is None:
            return
        self.unloaded = _read_names(self.shared)
        for name in sorted(self.unloaded):
            async with self._lock:
                retired = self.registry.remove(name) if self.registry.loaded_versions(name) else []
            if retired:
                await self._retire(name, retired)

    async def reload_changed(self) -> list[str]:
        """Load every model of the repository whose newest version changed on disk since its last load (a new
        version, a version changed in place, a new model); a failure is logged and leaves that model as it was.
        Returns the models loaded."""
        await self.follow()
        loader = self.registry.loader
        if loader is None:
            return []
        stamps, why = await anyio.to_thread.run_sync(_scan, loader, frozenset(self.unloaded))
        if stamps is None:
            if not self._repository_gone:
                log.warning("the model repository %s %s: the models loaded serve on, and nothing is reloaded until "
                            "it is back", loader.repository, why)
            self._repository_gone = True
            return []
        if self._repository_gone:
            log.info("the model repository %s is back", loader.repository)
            self._repository_gone = False
        loaded = []
        for name, stamp in stamps.items():
            if name in self.unloaded:
                continue  # unloaded while the scan ran: until it is loaded again
            current = self.registry.get(name)
            if stamp is None or (current is not None and current.stamp == stamp):
                continue  # unreadable (its load would say why), or served as it is on disk
            if name in loader.failed_stamps and loader.failed_stamps[name] == stamp:
                continue  # its load failed, and nothing changed since
            try:
                await self.load(name, tell=False)
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


def _scan(loader: Loader, unloaded: frozenset[str]) -> tuple[dict[str, Stamp | None] | None, str]:
    """The stamp of each model of the repository (but the `unloaded`), as on disk now; or None and why the
    repository cannot be read. Reads the disk: run it on a thread."""
    from export.repository import list_models

    try:  # moved, unmounted, its permissions changed: what is loaded serves on
        if not loader.repository.is_dir():
            return None, "is not there"
        folders = list_models(loader.repository)
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    return {d.name: loader.stamp(d.name) for d in folders if d.name not in unloaded}, ""


def _read_names(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except FileNotFoundError:
        return set()
