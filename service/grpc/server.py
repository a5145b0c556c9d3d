"""The Open Inference Protocol over gRPC: Triton's `inference.GRPCInferenceService`, a second front door
to the same core (service.core.dataplane), in the process that serves HTTP, on ATTEND_GRPC_PORT.

`GRPCServer` is a grpc.aio server on uvicorn's event loop: the entry point adds it to the Dataplane's
transports, whose lifespan starts it once the models are loaded and drains it at SIGTERM with HTTP
(service.core.dataplane.Transport). Its servicer turns each call into the core's calls, as
service.http.endpoint does for HTTP: admission (readiness, the API key from the `authorization`
metadata), the deadline (grpc-timeout, and `x-request-timeout-ms` metadata), the request's cost held
against the in-flight budget, the decode (service.grpc.codec; on a decode thread for large messages),
the batching (a gRPC request and an HTTP one share batches), the metrics (protocol "grpc") and Triton's
statistics, errors as status codes (service.grpc.status).

    ServerLive, ServerReady                   open, as HTTP's health probes
    ModelReady, ServerMetadata, ModelMetadata,
    ModelConfig, ModelStatistics, ModelInfer,
    ModelStreamInfer                          the API key, where ATTEND_API_KEYS is set
    RepositoryIndex, RepositoryModelLoad,
    RepositoryModelUnload                     model control (an admin key, as HTTP's /v2/repository)
    SystemSharedMemoryStatus, ...Register,
    ...Unregister                             where ATTEND_SHARED_MEMORY is on (an admin key where they are set)
    LogSettings, TraceSetting                 the API key to read them, an admin call to change them
    grpc.health.v1.Health Check, List, Watch  open: SERVING while ready (gRPC's standard health checking)
    everything else                           UNIMPLEMENTED

Transport limits (service.grpc.guard, as HTTP's connection guard): at most ATTEND_MAX_CONNECTIONS calls
under way (UNAVAILABLE past it; health calls exempt), each call's message within ATTEND_BODY_TIMEOUT_S
(DEADLINE_EXCEEDED) and of at most ATTEND_MAX_BODY_BYTES (RESOURCE_EXHAUSTED), ATTEND_MAX_OPEN_CONNECTIONS
connections; streams (ModelStreamInfer, Watch) at most ATTEND_MAX_OPEN_CONNECTIONS, each message of
ModelStreamInfer a call. A client that cancels, or goes away, is counted as HTTP counts it: 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import Settings
from service.core.control import check_parameters
from service.core.cost import Cost
from service.core.dataplane import Dataplane
from service.core.errors import ClientGone, DeadlineExceeded, RouteNotFound, ServiceError, excerpt
from service.core.exchange import Answer
from service.core.keys import check_api_key
from service.core.logs import log_access, log_settings, new_request_id
from service.core.request import find_model
from service.core.runtime import StartupError
from service.core.shm import Regions
from service.grpc import codec, guard
from service.grpc.codec import Wire
from service.grpc.drain import drain
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from service.grpc.proto import model_config_pb2
from service.grpc.status import CODES, details_of, end_call
from service.grpc.wire import Received
from service.protocols.v2 import config, extensions, metadata

log = logging.getLogger("service")

_SERVICE = "/inference.GRPCInferenceService/"
_CODEC = codec.GrpcCodec()
_STREAM_CODEC = codec.GrpcCodec(stream=True)
_INFER = "inference.GRPCInferenceService/ModelInfer"  # the request span's name and rpc.method
# The codes OpenTelemetry's conventions count as a gRPC server's error (the others are the client's).
_SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


class _Count:
    """A number as a load hint (service.core.dataplane.Dataplane.add_load_hint reads its len)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return self.n


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str | bytes]:
    return dict(context.invocation_metadata() or ())


def _authorization(metadata: dict[str, str | bytes]) -> bytes | None:
    value = metadata.get("authorization")
    return value.encode("latin-1", "replace") if isinstance(value, str) else value


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _rpc(method: Handler) -> Handler:
    """A call that is not ModelInfer: its errors as status codes, an access log line."""
    name = method.__name__

    @functools.wraps(method)
    async def call(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        status = 500
        try:
            answer = await method(self, request, context)
            status = 200
            return answer
        except ServiceError as e:
            status = e.status
            end_call(context, e)
        except Exception:
            log.exception("unhandled error in gRPC %s", name)
            end_call(context, ServiceError("internal server error"))
        finally:
            log_access("GRPC", name, status, time.perf_counter() - start)

    return call


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """Each RPC over the core; the methods it does not define answer UNIMPLEMENTED (the generated base)."""

    def __init__(self, dataplane: Dataplane, settings: Settings, version: str):
        self.dataplane = dataplane
        self.version = version
        self.max_batch = settings.max_batch
        self.in_progress = _Count()  # ModelInfer calls under way: the batching's load hint
        self.calls: guard.CallGuard | None = None  # the server's guard, which counts a stream's messages

    def _key(self, context: grpc.aio.ServicerContext) -> None:
        keys = self.dataplane.api_keys
        if keys:
            check_api_key(_authorization(_metadata(context)), keys)

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        self.dataplane.check_admin(_authorization(_metadata(context)))

    # ----------------------------------------------------------------------------------- health

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:  # noqa: N802
        try:
            self.dataplane.check_ready()
        except ServiceError:
            return pb.ServerReadyResponse(ready=False)
        return pb.ServerReadyResponse(ready=True)

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:  # noqa: N802
        self._key(context)
        try:
            find_model(self.dataplane.registry, request.name, request.version or None)
        except ServiceError:
            return pb.ModelReadyResponse(ready=False)  # as Triton: not an error
        return pb.ModelReadyResponse(ready=self.dataplane.ready)

    # --------------------------------------------------------------------------------- metadata

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any  # noqa: N802
                             ) -> pb.ServerMetadataResponse:
        self._key(context)
        return pb.ServerMetadataResponse(name="attend", version=self.version,
                                         extensions=extensions(self.dataplane.model_control,
                                                               self.dataplane.regions is not None))

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any  # noqa: N802
                            ) -> pb.ModelMetadataResponse:
        self._key(context)
        model = find_model(self.dataplane.registry, request.name, request.version or None)
        return codec.message_from(metadata(model), pb.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:  # noqa: N802
        self._key(context)
        model = find_model(self.dataplane.registry, request.name, request.version or None)
        return pb.ModelConfigResponse(config=codec.message_from(config(model, self.max_batch),
                                                                model_config_pb2.ModelConfig()))

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any  # noqa: N802
                              ) -> pb.ModelStatisticsResponse:
        self._key(context)
        report = self.dataplane.statistics(request.name or None, request.version or None)
        return codec.message_from(report, pb.ModelStatisticsResponse())

    # ------------------------------------------------------------------------- model repository

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any  # noqa: N802
                              ) -> pb.RepositoryIndexResponse:
        self._admin(context)
        rows = await asyncio.to_thread(self.dataplane.registry.index)  # reads the disk: never on the loop
        if request.ready:
            rows = [r for r in rows if r["state"] == "READY"]
        return codec.message_from({"models": rows}, pb.RepositoryIndexResponse())

    @_rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, context: Any  # noqa: N802
                                  ) -> pb.RepositoryModelLoadResponse:
        self._admin(context)
        check_parameters(request.parameters)
        await self.dataplane.control.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest, context: Any  # noqa: N802
                                    ) -> pb.RepositoryModelUnloadResponse:
        self._admin(context)
        check_parameters(request.parameters, unload=True)
        await self.dataplane.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------------------------ logging

    @_rpc
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Any) -> pb.LogSettingsResponse:  # noqa: N802
        """Triton's log settings: none in the request reads them (the API key); some change them (an admin call)."""
        if request.settings:
            self.dataplane.check_admin(_authorization(_metadata(context)), "changing the log settings")
            changes = {name: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
                       for name, value in request.settings.items()}
            settings = self.dataplane.update_log_settings(changes)
        else:
            self._key(context)
            settings = log_settings()
        response = pb.LogSettingsResponse()
        for name, value in settings.items():
            field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
            setattr(response.settings[name], field, value)
        return response

    # -------------------------------------------------------------------------------------- trace

    @_rpc
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Any  # noqa: N802
                           ) -> pb.TraceSettingResponse:
        """Triton's trace settings, global or a model's: none in the request reads them (the API key); some
        change them (an admin call); a setting with no value is cleared."""
        model = request.model_name or None
        if request.settings:
            self.dataplane.check_admin(_authorization(_metadata(context)), "changing the trace settings")
            changes = {name: list(value.value) or None for name, value in request.settings.items()}
            settings = self.dataplane.update_trace_settings(model, changes)
        else:
            self._key(context)
            settings = self.dataplane.get_trace_settings(model)
        response = pb.TraceSettingResponse()
        for name, value in settings.items():
            response.settings[name].value.extend(value if isinstance(value, list) else [value])
        return response

    # ----------------------------------------------------------------------- system shared memory

    def _regions(self, context: grpc.aio.ServicerContext) -> Regions:
        return self.dataplane.check_shared_memory(_authorization(_metadata(context)))

    @_rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest, context: Any  # noqa: N802
                                       ) -> pb.SystemSharedMemoryStatusResponse:
        regions = await asyncio.to_thread(self._regions(context).status, request.name)
        return codec.message_from({"regions": {r["name"]: r for r in regions}}, pb.SystemSharedMemoryStatusResponse())

    @_rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest, context: Any  # noqa: N802
                                         ) -> pb.SystemSharedMemoryRegisterResponse:
        await asyncio.to_thread(self._regions(context).register, request.name, request.key, request.offset,
                                request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,  # noqa: N802
                                           context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        await asyncio.to_thread(self._regions(context).unregister, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # -------------------------------------------------------------------------------- inference

    async def ModelInfer(self, request: Received | pb.ModelInferRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> Wire | None:
        # Ray Serve's proxy parses the message itself (service.grpc.proxied); the guard lifts its tensors out.
        exchange = GrpcExchange(request if isinstance(request, Received) else Received(request), context)
        self.in_progress.n += 1
        try:
            await self.dataplane.serve(exchange)
        finally:
            self.in_progress.n -= 1
        if exchange.answer is None:  # refused: `refuse` set the status
            return None
        if exchange.traceresponse is None:
            context.set_trailing_metadata((("x-request-id", exchange.rid),))
        else:
            context.set_trailing_metadata((("x-request-id", exchange.rid), ("traceresponse", exchange.traceresponse)))
        return exchange.answer

    async def ModelStreamInfer(self, messages: AsyncIterator[tuple[Any, int]],  # noqa: N802
                               context: grpc.aio.ServicerContext) -> None:
        """Triton's stream: each message a ModelInfer, served as it comes, its answer (or its error, as
        `error_message`) written as soon as it is ready, so in the order they finish (`id` pairs them).
        An error ends only its own request; with Triton's `triton_grpc_error: true` metadata, it ends the stream
        with its status code instead, and what else is under way on it is cancelled. Returns once the client
        half-closed and all are answered."""
        stream = _Stream(_metadata(context).get("triton_grpc_error", "").lower() == "true")
        if not stream.grpc_error:
            return await self._stream(messages, context, stream)
        serving = asyncio.ensure_future(self._stream(messages, context, stream))
        failed = asyncio.ensure_future(stream.failed.wait())
        try:
            await asyncio.wait((serving, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:  # an error, or the call cancelled: the stream's tasks end with it
            failed.cancel()
            if stream.error is not None or not serving.done():
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
        if stream.error is not None:
            end_call(context, stream.error)
        else:
            serving.result()

    async def _stream(self, messages: AsyncIterator[tuple[Any, int]], context: grpc.aio.ServicerContext,
                      stream: _Stream) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            async for item, size in messages:
                if isinstance(item, ServiceError):
                    # Refused by the guard, and not counted as a call: said before the next message is read,
                    # so that a client that sends and does not read is held back (grpc's flow control).
                    log_access("GRPC", "ModelStreamInfer", item.status, 0.0)
                    try:
                        await StreamExchange(Received(pb.ModelInferRequest()), context, stream).refuse(item)
                    except _StreamClosed:
                        break
                    continue
                task = asyncio.ensure_future(self._one_of_stream(item, size, context, stream))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(set(tasks))
        finally:
            for task in tasks:  # the stream was cancelled, or the client went away: theirs too
                task.cancel()

    async def _one_of_stream(self, item: Received, size: int, context: grpc.aio.ServicerContext,
                             stream: _Stream) -> None:
        """One message the guard counted as a call: served, and its call given back."""
        guard.message_size.set(size)  # this task's own context
        self.in_progress.n += 1
        try:
            await self.dataplane.serve(StreamExchange(item, context, stream))
        except _StreamClosed:
            pass  # the client went away: counted by serve
        finally:
            self.in_progress.n -= 1
            assert self.calls is not None
            self.calls.give()


class GrpcExchange:
    """One ModelInfer call, for service.core.exchange.serve: the message is the body; the answer is
    returned by the servicer, an error ends the call with its status code."""

    __slots__ = ("received", "target", "context", "headers", "authorization", "timeout_ms", "arrived", "rid",
                 "answer", "traceresponse")
    protocol = "grpc"
    method = "GRPC"
    codec = _CODEC
    rpc = _INFER
    disconnected = None  # grpc cancels the call's task instead

    def __init__(self, received: Received, context: grpc.aio.ServicerContext):
        self.arrived = time.monotonic()
        self.received = received
        message = received.message
        self.target = message.model_name, message.model_version or None
        self.context = context
        metadata = self.headers = _metadata(context)
        self.authorization = _authorization(metadata)
        self.timeout_ms = metadata.get("x-request-timeout-ms")
        rid = metadata.get("x-request-id")
        self.rid, _ = new_request_id(rid.encode("latin-1", "replace") if isinstance(rid, str) else rid)
        self.answer: Wire | None = None  # the ModelInferResponse, serialized where it was encoded
        self.traceresponse: str | None = None  # while tracing is on (`traced`)

    @property
    def message(self) -> pb.ModelInferRequest:
        return self.received.message

    def latest(self) -> float | None:
        remaining = self.context.time_remaining()  # grpc-timeout, where the client set a deadline
        return None if remaining is None else time.monotonic() + remaining

    def path(self, model: str) -> str:
        return f"ModelInfer {model}"

    async def body(self, cost: Cost, until: float) -> Received:
        # In memory already (at most ATTEND_MAX_BODY_BYTES): held first, so that a call that would take the
        # budget past its limit is refused as HTTP's body would be.
        cost.base = guard.message_size.get() or self.message.ByteSize()
        cost.hold(cost.base, "this request")
        return self.received

    def cancelled(self) -> ServiceError:
        remaining = self.context.time_remaining()
        if remaining is not None and remaining <= 0:
            return DeadlineExceeded("the call's deadline passed")
        return ClientGone("the client cancelled the call")

    async def send(self, answer: Answer) -> None:
        self.answer = answer.body

    async def refuse(self, error: ServiceError) -> None:
        trailing = (("x-request-id", self.rid),)
        if self.traceresponse is not None:
            trailing += (("traceresponse", self.traceresponse),)
        end_call(self.context, error, trailing)

    # Tracing (service.core.tracing; only while it is on): OpenTelemetry's conventions for RPC servers (gRPC).

    def span_start(self) -> tuple[str, dict[str, Any], str]:
        attributes: dict[str, Any] = {"rpc.system.name": "grpc", "rpc.method": self.rpc}
        peer = self.context.peer() or ""  # "ipv4:127.0.0.1:53536", "ipv6:[::1]:53536"
        kind, _, address = peer.partition(":")
        if kind in ("ipv4", "ipv6"):
            host, _, port = address.rpartition(":")
            attributes["client.address"] = host.strip("[]")
            if port.isdigit():
                attributes["client.port"] = int(port)
        form = "grpc raw" if self.received.raw_input_contents else "grpc contents"
        return self.rpc, attributes, form

    def span_end(self, status: int) -> tuple[dict[str, Any], bool]:
        code = CODES.get(status or 499, grpc.StatusCode.INTERNAL) if status != 200 else grpc.StatusCode.OK
        return {"rpc.response.status_code": code.name}, code in _SERVER_ERRORS

    def traced(self, traceresponse: str) -> None:
        self.traceresponse = traceresponse


class _StreamClosed(Exception):
    """An answer for a stream that has ended (the client cancelled it, or went away)."""


class _Stream:
    """What the messages of one ModelStreamInfer call share: one write at a time on it; with `triton_grpc_error`,
    the first error, which ends it."""

    __slots__ = ("writing", "grpc_error", "error", "failed")

    def __init__(self, grpc_error: bool):
        self.writing = asyncio.Lock()
        self.grpc_error = grpc_error
        self.error: ServiceError | None = None
        self.failed = asyncio.Event()  # set with `error`


class StreamExchange(GrpcExchange):
    """One message of a ModelStreamInfer call: the answer and the error are messages on the stream."""

    __slots__ = ("stream",)
    codec = _STREAM_CODEC
    rpc = "inference.GRPCInferenceService/ModelStreamInfer"

    def __init__(self, received: Received, context: grpc.aio.ServicerContext, stream: _Stream):
        super().__init__(received, context)
        self.stream = stream

    def path(self, model: str) -> str:
        return f"ModelStreamInfer {model}"

    async def send(self, answer: Answer) -> None:
        await self._write(answer.body)

    async def refuse(self, error: ServiceError) -> None:
        stream = self.stream
        if stream.grpc_error:  # the stream ends with it (ModelStreamInfer)
            if stream.error is None:
                stream.error = error
                stream.failed.set()
            return
        message = self.message
        answer = pb.ModelStreamInferResponse(error_message=details_of(error))
        answer.infer_response.id, answer.infer_response.model_name = message.id, message.model_name
        answer.infer_response.model_version = message.model_version
        await self._write(answer)

    async def _write(self, body: pb.ModelStreamInferResponse) -> None:
        async with self.stream.writing:
            if self.context.done() or self.stream.error is not None:
                raise _StreamClosed
            await self.context.write(body)


def _unimplemented(name: str) -> Handler:
    async def call(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        log_access("GRPC", name, 501, 0.0)
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details(f"this server does not implement {name}")

    call.__name__ = name
    return call


# What the service does not serve (CUDA shared memory, trace settings) answers UNIMPLEMENTED
# itself: the generated base class's methods raise NotImplementedError, run on a thread, and are logged
# with a traceback by grpc.
for _name, _method in vars(pb_grpc.GRPCInferenceServiceServicer).items():
    if not _name.startswith("_") and callable(_method) and _name not in vars(Servicer):
        setattr(Servicer, _name, _unimplemented(_name))


_WATCH_S = 0.5  # how often the status is checked for Watch (once for all its streams)
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health_pb2_grpc.HealthServicer):
    """gRPC's standard health checking (grpc.health.v1), for Kubernetes' grpc probes, grpc-health-probe and
    gRPC's client-side health checking (Watch): SERVING while the service is ready (ServerReady's answer),
    NOT_SERVING while it loads or stops."""

    SERVICES = ("", "inference.GRPCInferenceService")  # the server, and its one service

    def __init__(self, dataplane: Dataplane, calls: guard.CallGuard):
        self.dataplane = dataplane
        self.calls = calls
        self._watchers = 0
        self._changed = asyncio.Event()  # set when the status changes, then replaced
        self._ticker: asyncio.Future | None = None

    def _status(self) -> int:
        try:
            self.dataplane.check_ready()
        except ServiceError:
            return _NOT_SERVING
        return _NOT_SERVING if self.calls.stopping else _SERVING

    @_rpc
    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any  # noqa: N802
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.SERVICES:
            raise RouteNotFound(f"no service {excerpt(request.service)} here: ask for '' (the server) or "
                                "'inference.GRPCInferenceService'")
        return health_pb2.HealthCheckResponse(status=self._status())

    @_rpc
    async def List(self, request: health_pb2.HealthListRequest, context: Any  # noqa: N802
                   ) -> health_pb2.HealthListResponse:
        status = health_pb2.HealthCheckResponse(status=self._status())
        return health_pb2.HealthListResponse(statuses=dict.fromkeys(self.SERVICES, status))

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any  # noqa: N802
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The status now, then each change (within _WATCH_S; at once at SIGTERM, which then ends the stream);
        a service not here SERVICE_UNKNOWN, and the stream stays open, as the protocol has it."""
        self._watchers += 1
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick())
        start, ended = time.perf_counter(), 0  # 0: the client ended it (499); 503: the stop did
        try:
            sent = None
            while True:
                changed = self._changed  # before the status: a change from now on wakes this stream
                status = self._status() if request.service in self.SERVICES else \
                    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != sent:
                    sent = status
                    yield health_pb2.HealthCheckResponse(status=status)
                if self.calls.stopping:
                    ended = 503  # the guard ends it UNAVAILABLE
                    return
                await changed.wait()
        finally:
            self._watchers -= 1
            log_access("GRPC", "Watch", ended, time.perf_counter() - start)  # its end, as a stream's line

    async def _tick(self) -> None:
        """While a Watch is open: the status every _WATCH_S, its streams woken where it changed."""
        last = self._status()
        while self._watchers and not self.calls.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.calls.stopped(), _WATCH_S)
            status = self._status()
            if status != last or self.calls.stopping:
                last = status
                self._changed.set()
                self._changed = asyncio.Event()
        self._ticker = None


def tls_credentials(settings: Settings) -> grpc.ServerCredentials:
    """ATTEND_GRPC_TLS_*'s credentials (checked already, as the settings were read)."""
    assert settings.grpc_tls_cert is not None and settings.grpc_tls_key is not None
    ca = settings.grpc_tls_client_ca
    return grpc.ssl_server_credentials([(settings.grpc_tls_key.read_bytes(), settings.grpc_tls_cert.read_bytes())],
                                       root_certificates=None if ca is None else ca.read_bytes(),
                                       require_client_auth=ca is not None)


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _gone_early(dataplane: Dataplane, name: str, seconds: float) -> None:
    """A ModelInfer whose client went away before its message was in: counted as HTTP counts a client gone
    during its body (499, attend_client_gone), under no model's name (the message named none yet)."""
    if name == "ModelInfer":
        dataplane.failed("-", ClientGone("the client went away before its message arrived"), seconds, None, "grpc")


class _AnswerNotSent(logging.Filter):
    """grpcio logs an ERROR with its traceback when the answer of a call cannot be written: the client
    closed the call, or refused a message over its own limit (tritonclient's default is 4 MiB, and the
    attention weights of one request can be more). Any client can cause that at every call, and it is not
    the service's error: one warning line instead (the client has its own status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "ExecuteBatchError":
            # "ExecuteBatchError raised in core by servicer method [/inference.GRPCInferenceService/ModelInfer]":
            # a method of ours (grpc calls no servicer for another).
            where = record.getMessage().partition(" raised in core by ")[2] or "a gRPC call"
            record.msg = "%s: the answer could not be sent (the client closed the call, or its message limit " \
                         "refused the answer)"
            record.args = (where,)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


# On grpcio's logger as soon as the gRPC front door is imported (the logging set-up replaces handlers, not a
# logger's filters).
logging.getLogger("grpc._cython.cygrpc").addFilter(_AnswerNotSent())


class GRPCServer:
    """The gRPC front door as a transport of the Dataplane (service.core.dataplane.Transport).
    `shared_port`: the workers of ATTEND_WORKERS bind the same port (SO_REUSEPORT; the kernel spreads
    the connections over them); one process alone does not, so a port in use is an error."""

    def __init__(self, settings: Settings, version: str, shared_port: bool = False):
        self.settings = settings
        self.version = version
        self.shared_port = shared_port
        self.server: grpc.aio.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Future | None = None
        self.calls: guard.CallGuard | None = None
        self.port = 0
        self.address = grpc_address(settings.host, settings.grpc_port)

    async def start(self, dataplane: Dataplane) -> None:
        settings = self.settings
        self.loop = asyncio.get_running_loop()
        server = grpc.aio.server(options=guard.options(settings.max_body_bytes, settings.max_open_connections,
                                                       self.shared_port, settings.header_timeout_s))
        servicer = Servicer(dataplane, settings, self.version)
        self.calls = servicer.calls = calls = guard.CallGuard(
            settings.max_connections, settings.body_timeout_s, dataplane.metrics.refusals,
            functools.partial(_gone_early, dataplane), settings.max_open_connections, settings.max_body_bytes)
        calls.register(server, pb_grpc.add_GRPCInferenceServiceServicer_to_server, servicer)
        calls.register(server, health_pb2_grpc.add_HealthServicer_to_server, Health(dataplane, calls))
        try:
            if settings.grpc_tls_cert is None:
                port = server.add_insecure_port(self.address)
            else:
                port = server.add_secure_port(self.address, tls_credentials(settings))
        except RuntimeError as e:
            port, reason = 0, str(e)
        else:
            reason = "the port is in use or the address cannot be bound"
        if not port:
            raise StartupError(f"cannot serve gRPC on {self.address} (ATTEND_GRPC_PORT): {reason}")
        await server.start()
        self.server, self.port = server, port
        dataplane.add_load_hint(servicer.in_progress, servicer.in_progress)
        tls = "" if settings.grpc_tls_cert is None else ", mutual TLS" if settings.grpc_tls_client_ca else ", TLS"
        log.info("gRPC (Triton's GRPCInferenceService) on %s%s", self.address, tls)

    def stop_accepting(self) -> None:
        """No new calls from now on (UNAVAILABLE); those under way have ATTEND_GRACE_PERIOD_S, and grpc
        stops once their answers are acknowledged (service.grpc.drain). Safe from a signal handler: the
        stop begins on the event loop."""
        if self.server is None or self.loop is None or self.stopping is not None:
            return
        self.stopping = self.loop.create_future()  # set now: a second call begins nothing
        self.loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        assert self.server is not None and self.stopping is not None
        stopping = self.stopping
        task = asyncio.ensure_future(self._drain_and_stop())
        task.add_done_callback(lambda t: stopping.set_result(None) if not stopping.done() else None)

    async def _drain_and_stop(self) -> None:
        assert self.server is not None and self.calls is not None
        await self.server.stop(await drain(self.calls, self.port, self.settings.grace_period_s))

    async def stop(self) -> None:
        if self.server is None:
            return
        self.stop_accepting()
        assert self.stopping is not None
        await self.stopping
        log.info("gRPC stopped")
