"""The infer core that every transport holds: one `Dataplane` a process (an app), below every protocol.

    open()/close()        the models loaded and warmed up, the batching and model control started;
                          then stopped, what is queued finished first
    ready, check_ready()  readiness (off at SIGTERM: `stop_accepting`); `serving` stays on while draining
    admit() ... release() one request's admission (readiness, the API key) and accounting (in flight,
                          its cost in memory against the budget, the request metrics by model and
                          status, 499 for a client that went away)
    deadline()            when a request must be answered (ATTEND_REQUEST_TIMEOUT_S, or the client's
                          shorter X-Request-Timeout-Ms); `within(until)` bounds the body's read and decode
    serve()               one inference request's whole life (service.core.exchange), for every transport
    infer()               the batching queue, the session run, the codec's encoder
    answered(), failed()  a request's answer or error counted: metrics by model, status and protocol,
                          and the statistics of its model version (Triton's extension: `statistics()`)
    check_admin()         model control's access (ATTEND_ADMIN_KEYS, ATTEND_MODEL_CONTROL)
    set_load_hint()       what the server says of its load: requests in progress, busy clients
    transports            further front doors beside the server that runs the app (gRPC's), started
                          by open(), told to stop taking requests by stop_accepting(), drained by close()

A transport (service.http.endpoint, service.grpc.server) hands each inference request to `serve` as an
`Exchange` and writes what comes back, so that a second transport cannot forget a check. Knows no web
framework.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sized
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from service.core import tracing
from service.core.batching import BatchLimits, Encoder, Job, Scheduler
from service.core.control import ModelControl
from service.core.cost import Budget, Cost
from service.core.deadline import Within, on_thread
from service.core.errors import (
    ClientGone,
    ControlOff,
    DeadlineExceeded,
    InvalidHeader,
    NotReady,
    PayloadTooLarge,
    ServiceError,
)
from service.core.exchange import Exchange, serve
from service.core.gpu import device_budget
from service.core.keys import check_api_key
from service.core.load import InFlight, Total
from service.core.logs import apply_log_settings, changed_log_settings, escape
from service.core.memory import trim_memory
from service.core.metrics import Metrics
from service.core.request import Request, RequestLimits, find_model
from service.core.runtime import CUDA, LoadedModel, Registry
from service.core.shm import Regions, SharedMemoryOff
from service.core.tracesettings import TraceSettings

log = logging.getLogger("service")
T = TypeVar("T")


_SWITCH_INTERVAL_S = 0.001


class CoreSettings(Protocol):
    """What the core reads of the settings (service.config.Settings has it all)."""

    model_repository: Path
    device: str
    cuda_tf32: bool
    warmup: bool
    graph_timing_s: float
    flush_denormals: bool
    skip_broken_models: bool
    inline_decode_bytes: int
    max_inflight_bytes: int
    max_device_bytes: int
    workers: int
    request_timeout_s: float
    keep_versions: int
    grace_period_s: float
    poll_s: float

    model_control: bool
    shared_memory: bool

    def request_limits(self) -> RequestLimits: ...
    def batch_limits(self) -> BatchLimits: ...
    def resolved_intra_op_threads(self) -> int: ...
    def resolved_inference_threads(self) -> int: ...
    def api_key_list(self) -> tuple[bytes, ...]: ...
    def admin_key_list(self) -> tuple[bytes, ...]: ...


class Transport(Protocol):
    """A front door that the app's lifespan runs beside the server that runs the app (gRPC's, where
    the entry point adds it to `Dataplane.transports`): it shares the core, its models and batching."""

    async def start(self, dataplane: Dataplane) -> None:
        """Take requests (the models are loaded and the batching runs); raise StartupError if it cannot."""

    def stop_accepting(self) -> None:
        """SIGTERM: take no new requests; those in flight go on (`stop` waits for them)."""

    async def stop(self) -> None:
        """Stop once the requests in flight are answered, within ATTEND_GRACE_PERIOD_S."""


def load_registry(settings: CoreSettings, timings_folder: str | None = None) -> Registry:
    """Every model of the repository, loaded, checked and warmed up (StartupError: why not). `timings_folder`:
    where the processes of one start share the graphs' times (service.core.choice.SharedTimings)."""
    return Registry.load(settings.model_repository, settings.device, settings.resolved_intra_op_threads(),
                         settings.cuda_tf32, settings.warmup, settings.skip_broken_models, settings.graph_timing_s,
                         settings.flush_denormals, timings_folder)


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class Dataplane:
    """The core of one app: see the module's docstring. Built with the app, opened by its lifespan."""

    def __init__(self, settings: CoreSettings, metrics: Metrics | None = None, registry: Registry | None = None,
                 timings_folder: str | None = None):
        self.settings = settings
        self.timings_folder = timings_folder  # the start's shared folder (workers): graphs' times, unloaded names
        self.metrics = metrics or Metrics()
        self.limits = settings.request_limits()
        self.api_keys = settings.api_key_list()
        self.admin_keys = settings.admin_key_list()
        # The model repository extension (load, unload, the index) is on: admin keys, or opened for all.
        self.model_control = bool(self.admin_keys or settings.model_control)
        # Triton's system shared memory, where it is on: the regions (with workers, a file they share).
        self.regions: Regions | None = None
        if settings.shared_memory:
            self.regions = Regions(None if timings_folder is None else Path(timings_folder) / "regions.json")
        self.request_timeout_s = settings.request_timeout_s
        self.inline_decode_bytes = settings.inline_decode_bytes
        self.budget = Budget(settings.max_inflight_bytes)  # what the requests in flight may cost together
        self.device_budget: Budget | None = None  # ... of the GPU's memory (open(): once the models are loaded)
        self.registry: Registry = registry  # type: ignore[assignment]  # loaded by open() unless given
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # made by open()
        self.control: ModelControl = None  # type: ignore[assignment]
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.loop_thread: int | None = None  # the event loop's thread: a decode there reads little shared memory
        self.ready = False  # every model loaded and warmed up, not stopping
        self.serving = False  # requests are taken: from open() to close(), draining included
        self.in_flight = 0  # requests between admit() and release() (the in-flight gauge reads it)
        self.served_since_trim = 0  # requests since the heap was last trimmed (_trim_memory_when_idle)
        # What the server says of its load (set_load_hint): the requests in progress in the server: a
        # request that is the only one has nobody to wait for to share a batch.
        self.requests_in_progress: Sized = InFlight(self)
        self.transports: list[Transport] = []  # added by the entry point before open()
        self.tracing = False  # this core set tracing up (OTEL_*), and shuts it down at close()
        self.trace_settings = TraceSettings(False)  # Triton's trace extension: which requests are traced
        self._server_hint: tuple[Sized, Sized] | None = None
        self._transport_hints: list[tuple[Sized, Sized]] = []
        self._decoder: ThreadPoolExecutor | None = None
        # Large JSON bodies' parse in processes (service.protocols.json_process), where the app set them up.
        self.json_processes: Any = None
        self.metrics.in_flight_from(lambda: self.in_flight)
        budget = self.budget
        self.metrics.track_limits(lambda: budget.used, budget.limit, settings.max_queue, settings.request_timeout_s)

    # ------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        """Load the models (in a thread, unless given), start the batching and model control, then
        be ready. Sessions are created here, once, never at import time."""
        settings = self.settings
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        # OTEL_*: off unless they configure it (python -m service checked them before anything: TracingError).
        self.tracing = tracing.setup(self.metrics)
        self.trace_settings = TraceSettings(self.tracing, self.timings_folder,
                                            None if self.timings_folder is None else self.share)
        if self.registry is None:
            self.registry = await asyncio.to_thread(load_registry, settings, self.timings_folder)
        registry = self.registry
        on_cuda = any(registry.get(n).provider == CUDA for n in registry.names())
        device_limit = device_budget(settings.max_device_bytes, on_cuda, settings.workers)
        if device_limit:
            self.device_budget = Budget(device_limit, "ATTEND_MAX_DEVICE_BYTES", "GPU memory" if on_cuda else
                                        "the execution provider's memory")
            device = self.device_budget
            self.metrics.track_device(lambda: device.used, device.limit)
        threads = settings.resolved_inference_threads()
        self.scheduler = Scheduler([registry.get(n) for n in registry.names()], settings.batch_limits(), threads,
                                   self.metrics)
        self.scheduler.start()
        self._decoder = ThreadPoolExecutor(threads, thread_name_prefix="decode")
        # The event loop and the decode threads share the GIL. A decode thread parsing a large body
        # gives it up only when asked, after the switch interval, and the loop asks again after each of
        # its polls: a shorter interval keeps health probes answered under a burst of large bodies
        # (tests/service/test_bounded.py; the figures: docs/archive.md).
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        # A worker of several: model control reaches them all, through a file they share and SIGHUP to the
        # supervisor, which passes it on.
        workers = {} if self.timings_folder is None else {
            "shared": Path(self.timings_folder) / "unloaded.json",
            "notify": functools.partial(tell_supervisor, os.getppid())}
        self.control = ModelControl(registry, self.scheduler, settings.keep_versions, settings.grace_period_s,
                                    counted=self.metrics.model_loaded, **workers)
        await self.control.follow()  # a worker started in place of one that died: as the others
        self.follow_settings()
        if settings.poll_s:
            self.scheduler.spawn(self.control.poll(settings.poll_s))
        self.scheduler.spawn(_trim_memory_when_idle(self))
        if self.metrics.sample():  # with workers: what a scrape reads, written once a second
            self.scheduler.spawn(_sample_metrics(self.metrics))
        in_flight = InFlight(self)  # until the server says more (set_load_hint)
        self.set_load_hint(in_flight, in_flight)
        self.serving = True
        try:
            for transport in self.transports:
                await transport.start(self)
        except BaseException:
            await self.close()
            raise
        self.ready = True
        self.metrics.ready.set(1)
        count = len(registry.names())
        log.info("ready: %d model%s from %s", count, "" if count == 1 else "s", settings.model_repository)

    async def close(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)
        for transport in self.transports:  # what they took in is answered before the batching stops
            transport.stop_accepting()
        for transport in self.transports:
            try:
                await transport.stop()
            except Exception:
                log.exception("stopping a transport failed")
        self.serving = False
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)
        if self.tracing:
            self.tracing = False
            await asyncio.to_thread(tracing.shutdown)  # the spans still queued sent (bounded), off the loop
        self.metrics.worker_exit()

    def stop_accepting(self) -> None:
        """SIGTERM (on the event loop, not in the signal handler: the metrics take locks): readiness turns
        off at once; requests already sent are still served. The transports take no new requests from
        now on (the server of the app stops accepting itself)."""
        self.ready = False
        self.metrics.ready.set(0)
        for transport in self.transports:
            transport.stop_accepting()

    def reload_changed(self, signalled: bool = True) -> None:
        """SIGHUP: load every model whose newest version in the repository is not the one served (and once
        the server handles SIGHUP, `signalled` false: for what changed while it started)."""
        self.follow_settings()  # with workers, another's change of the log or trace settings sent the SIGHUP
        if self.ready:
            if signalled:
                log.info("SIGHUP: loading the models whose newest version changed")
            self.scheduler.spawn(self.control.reload_changed())

    def set_load_hint(self, requests_in_progress: Sized, busy_clients: Sized) -> None:
        """What the server knows of its load, for the batching: the requests in progress (one alone
        runs at once), and the clients busy sending requests (how many a batch can wait for). The
        transports' hints (`add_load_hint`) are added to it."""
        self._server_hint = (requests_in_progress, busy_clients)
        self._apply_load_hints()

    def add_load_hint(self, requests_in_progress: Sized, busy_clients: Sized) -> None:
        """A transport's share of the load (its requests in progress, its busy clients), counted with the
        server's: a gRPC request and an HTTP one wait for each other to share a batch."""
        self._transport_hints.append((requests_in_progress, busy_clients))
        self._apply_load_hints()

    def _apply_load_hints(self) -> None:
        server = self._server_hint
        hints = [server] if server is not None else []
        if server is None or not isinstance(server[0], InFlight):  # InFlight counts every transport's already
            hints += self._transport_hints
        if len(hints) == 1:
            self.requests_in_progress, busy = hints[0]
        else:
            self.requests_in_progress, busy = Total([h[0] for h in hints]), Total([h[1] for h in hints])
        self.scheduler.busy_clients = busy

    def check_ready(self) -> None:
        """Ready: started, not stopping, and every model that should be served is (one that could not
        be loaded at start, kept out by ATTEND_SKIP_BROKEN_MODELS, is not; one unloaded on purpose does
        not count). Raises NotReady saying why."""
        if not self.ready:
            raise NotReady("not ready", headers={"Retry-After": "1"})
        broken = self.registry.broken
        if broken:
            raise NotReady(f"not ready: model(s) {', '.join(sorted(broken))} could not be loaded (GET /models "
                           "says why)")

    # ------------------------------------------------------------------------------- one request

    def admit(self, authorization: bytes | None) -> None:
        """Take a request in (then `release` it, once): NotReady unless serving, Unauthorized without a
        valid key where keys are set. Not `ready`: that turns off at SIGTERM, while requests sent
        before it still get served (the server stops taking new ones itself)."""
        if not self.serving:
            raise NotReady("the service is not ready", headers={"Retry-After": "1"})
        if self.api_keys:
            check_api_key(authorization, self.api_keys)
        self.in_flight += 1
        self.served_since_trim += 1
        self.metrics.request_started()

    def check_admin(self, authorization: bytes | None, what: str = "model control") -> None:
        """An admin call (model control: load, unload, the repository index; a change of the log settings): an
        admin key where ATTEND_ADMIN_KEYS is set; else off (ControlOff, 404), unless ATTEND_MODEL_CONTROL=true
        opens it (then the API keys, if any, apply as to every route). `what`: the call, for the refusal."""
        if self.admin_keys:
            check_api_key(authorization, self.admin_keys)
        elif not self.model_control:
            raise ControlOff(f"{what} is off: set ATTEND_ADMIN_KEYS (or ATTEND_MODEL_CONTROL=true on a trusted "
                             "network)")
        elif self.api_keys:
            check_api_key(authorization, self.api_keys)

    def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Triton's log settings changed (service.core.logs): here, and with workers in them all (`share`)."""
        settings = changed_log_settings(changes)
        # Before: where the new settings turn warnings off, the line is still there.
        log.warning("log settings changed: %s", ", ".join(f"{k}={v}" for k, v in sorted(changes.items())))
        apply_log_settings(settings)
        if self.timings_folder is not None:
            self.share("log.json", settings)
        return settings

    def get_trace_settings(self, model: str | None) -> dict[str, Any]:
        """Triton's trace settings, the global ones or (`model`, served) a model's."""
        if model:
            find_model(self.registry, model)
        return self.trace_settings.get(model)

    def update_trace_settings(self, model: str | None, changes: dict[str, Any]) -> dict[str, Any]:
        """Triton's trace settings changed, the global ones or (`model`, served) a model's
        (service.core.tracesettings): here, and with workers in them all."""
        if model:
            find_model(self.registry, model)
        settings = self.trace_settings.update(model, changes)
        log.warning("trace settings of %s changed: %s", escape(model) if model else "every model",
                    ", ".join(f"{k}={escape(str(v))[:40]}" for k, v in sorted(changes.items())))
        return settings

    def share(self, name: str, settings: Any) -> None:
        """With workers: `settings` in file `name` of the folder they share, and SIGHUP to the supervisor, which
        passes it to each (they read it: `follow_settings`)."""
        file = Path(self.timings_folder) / name
        with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False) as out:
            json.dump(settings, out)
        os.replace(out.name, file)
        tell_supervisor(os.getppid())

    def follow_settings(self) -> None:
        """With workers: the log and trace settings another worker was given, if any."""
        if self.timings_folder is None:
            return
        shared = {}
        for name in ("log.json", "trace.json"):
            try:
                shared[name] = json.loads((Path(self.timings_folder) / name).read_bytes())
            except FileNotFoundError:
                pass
        if "log.json" in shared:
            apply_log_settings(shared["log.json"])
        self.trace_settings.follow(shared.get("trace.json"))

    def check_shared_memory(self, authorization: bytes | None) -> Regions:
        """System shared memory's register, status and unregister: on (ATTEND_SHARED_MEMORY), and an admin key
        where ATTEND_ADMIN_KEYS is set (else the API keys, if any, as every route)."""
        if self.regions is None:
            raise SharedMemoryOff("system shared memory is off: ATTEND_SHARED_MEMORY=true turns it on, for clients "
                                  "on this host")
        keys = self.admin_keys or self.api_keys
        if keys:
            check_api_key(authorization, keys)
        return self.regions

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.request_ended()

    def answered(self, model: str, status: int, seconds: float, snapshot: LoadedModel | None = None,
                 protocol: str = "http") -> None:
        """A response sent (status and latency by model and protocol; `seconds` since the request arrived),
        and a success in the statistics of `snapshot`, the model version that answered (where the
        transport does not say: the version served now)."""
        self.metrics.answered(model, status, seconds, protocol)
        if snapshot is None:
            snapshot = self.registry.get(model)
            if snapshot is None:
                return
        snapshot.statistics.succeeded(seconds)

    def failed(self, model: str, error: ServiceError, seconds: float | None = None,
               version: int | str | None = None, protocol: str = "http") -> int:
        """An error to answer: counted; its status, or 0 where nothing is to be sent (the client went
        away: 499, as nginx counts it). With `seconds` (since the request arrived), a failure in the
        statistics of the model's version (the error's, where decoding the body found it; else `version`,
        the one the path named; else the newest) where it is loaded."""
        gone = isinstance(error, ClientGone)
        self.metrics.failed(model, error.status, gone, protocol)
        if seconds is not None:
            if error.version is not None:
                version = error.version
            if isinstance(version, str):
                version = int(version) if version.isascii() and version.isdigit() else -1  # none is loaded
            snapshot = self.registry.get(model, version)
            if snapshot is not None:
                snapshot.statistics.failed(seconds)
        return 0 if gone else error.status

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension (service.core.statistics): `{"model_stats": [...]}` for every
        loaded version of every model (`name` None or ""), of one model, or of one version of it (`version`
        None or "": all of them); an unknown model or version raises what an inference request for it
        would (service.core.request.find_model). This process's numbers only."""
        registry = self.registry
        if not name:
            snapshots = [registry.get(n, v) for n in registry.names() for v in registry.loaded_versions(n)]
        elif not version:
            find_model(registry, name)
            snapshots = [registry.get(name, v) for v in registry.loaded_versions(name)]
        else:
            snapshots = [find_model(registry, name, version)]
        return {"model_stats": [s.statistics.report(s.name, s.version_text) for s in snapshots if s is not None]}

    def deadline(self, timeout_ms: bytes | str | None, arrived: float | None = None) -> float:
        """When the request must be answered: ATTEND_REQUEST_TIMEOUT_S, or the client's shorter
        X-Request-Timeout-Ms, after it arrived (time.monotonic(); now, where the server does not say)."""
        timeout = self.request_timeout_s
        if timeout_ms is not None:
            try:
                ms = float(timeout_ms)
            except ValueError:
                ms = float("nan")
            if not 0 < ms < float("inf"):  # 0, negative, inf and nan are client mistakes, not deadlines passed
                shown = timeout_ms.decode("latin-1") if isinstance(timeout_ms, bytes) else timeout_ms
                raise InvalidHeader("X-Request-Timeout-Ms must be a positive number of milliseconds",
                                    field="X-Request-Timeout-Ms", received=shown[:100])
            timeout = min(timeout, ms / 1000)
        return (arrived if arrived is not None else time.monotonic()) + timeout

    def within(self, until: float, what: str = "its body was read and decoded") -> Within:
        """`with dataplane.within(until):` the block is cancelled at `until` and raises
        DeadlineExceeded: on a loaded server the body of a large request can take seconds to come in,
        and its decode waits for a thread (past the deadline: 504, and the decode is never started)."""
        return Within(self.loop, until, what)

    def cost(self) -> Cost:
        """A request's share of the in-flight budget (service.core.cost): the transport holds its body's
        bytes in it, the codec what its decode holds, `infer` its arrays and answer; `release` gives it
        back."""
        return Cost(self.budget)

    async def in_thread(self, deadline: float, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a decode thread, so that the event loop goes on meanwhile; never started once
        the deadline has passed. The caller bounds the wait (`within`)."""

        def unless_late() -> T:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("the request's deadline passed before its body could be decoded")
            on_thread.until = deadline
            return work(*args)

        future = self.loop.run_in_executor(self._decoder, unless_late)
        # However this ends, nobody may be left to read the result: say it is read.
        future.add_done_callback(_retrieved)
        try:
            return await future
        finally:
            if not future.done():
                future.cancel()  # still queued: never started; under way: its result is dropped

    async def serve(self, exchange: Exchange) -> int:
        """One inference request, from admission to its answer (service.core.exchange.serve): its status."""
        return await serve(self, exchange)

    async def infer(self, request: Request, deadline: float, encode: Encoder, is_disconnected: Any = None,
                    cost: Cost | None = None, trace: tracing.RequestTrace | None = None) -> Any:
        """The encoded response for `request`, through the batching queue. Its arrays, run and answer are
        held in `cost` first (the body's parse is over: what it held is not). `trace`: its sampled trace,
        which the batching stamps (its queue, its share of the run, its encode)."""
        if trace is None:
            job = Job(request, deadline, encode, is_disconnected)
        else:
            job = trace.job = Job(request, deadline, trace.encoder(encode), is_disconnected)
            job.trace = trace
        if job.unindexable:
            raise PayloadTooLarge(f"batch * heads * n_q * n_k of {request.model.name}'s attention weights reaches "
                                  "2^31 elements, past what ONNX Runtime's CUDA kernels index; ask for no weights "
                                  "(return_weights: false, or only outputs) to run the fused kernel",
                                  expected=f"< {1 << 31}")
        if cost is not None:
            cost.hold(request.held + job.cost, "this request's answer")
        if self.device_budget is None:
            return await self.scheduler.submit(job, alone=len(self.requests_in_progress) <= 1)
        device = Cost(self.device_budget)
        device.hold(job.device, "this request's run")  # refused before it runs, never out of memory in it
        try:
            return await self.scheduler.submit(job, alone=len(self.requests_in_progress) <= 1)
        finally:
            device.release()


async def _sample_metrics(metrics: Metrics, every_s: float = 1.0) -> None:
    """Multiprocess mode: the in-flight bytes written for the scrapes (read at scrape time otherwise)."""
    while True:
        await asyncio.sleep(every_s)
        metrics.sample()


def _give_memory_back(registry: Registry) -> None:
    try:
        registry.shrink_arena()  # first: what the arena frees goes to glibc's heaps, trimmed next
    except Exception as e:  # a model unloaded meanwhile, say: the next quiet period tries again
        log.warning("could not shrink ONNX Runtime's arena: %s", e)
    trim_memory()


def tell_supervisor(supervisor: int) -> None:
    """SIGHUP to a worker's supervisor, which passes it to every worker; none once it is gone: the worker's
    parent is then another process (init; as root on a host, systemd, which SIGHUP makes reload)."""
    if os.getppid() == supervisor:
        os.kill(supervisor, signal.SIGHUP)


async def _trim_memory_when_idle(dataplane: Dataplane, every_s: float = 2.0) -> None:
    """After requests, once a whole period passed with none arriving and none in flight, give freed
    heap memory back to the system (glibc keeps it otherwise, resident after a burst of large bodies:
    docs/reliability.md). Not under steady load: the next requests would fault the pages in again."""
    seen = 0
    while True:
        await asyncio.sleep(every_s)
        served = dataplane.served_since_trim
        if served and served == seen and not dataplane.in_flight:
            await asyncio.to_thread(_give_memory_back, dataplane.registry)
            dataplane.served_since_trim = served = 0
        seen = served
