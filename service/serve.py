"""The service as a Ray Serve deployment: the app of `python -m service` (`create_app`), one copy per
replica, behind `@serve.ingress`. Needs the `ray` extra; nothing else in the service imports it.

    serve run deploy/ray/serve.yaml        one machine (a local Ray is started)
    serve deploy deploy/ray/serve.yaml     a running cluster (`ray start --head`, `ray start --address`)

Each replica does what `python -m service` does before it listens: reads the ATTEND_* settings of its
environment (the Serve config's `runtime_env.env_vars`), sets up the log, builds the app. Serve runs
the app's lifespan inside the replica, before the replica is counted as started, with uvicorn's own
lifespan code (`ASGIAppReplicaWrapper._run_asgi_lifespan_startup`, ray 2.60), and on the event loop that
then serves the replica's requests (`initialize_callable` and `_call_http_entrypoint` both run on the
replica's user-code loop): so the models are loaded and warmed up and the batching scheduler runs on
the right loop before a request comes, and a repository that cannot be served fails the replica's start.

What Serve does in place of the uvicorn process: the HTTP server (its proxy, or HAProxy), the bound on
requests at once (`max_ongoing_requests` a replica, `max_queued_requests` waiting before 503, in place
of ATTEND_MAX_CONNECTIONS), and the stop (a stopping replica gets no new requests, those in flight get
`graceful_shutdown_timeout_s`, ATTEND_GRACE_PERIOD_S's default, then the lifespan's shutdown runs).
ATTEND_HOST, ATTEND_PORT and ATTEND_WORKERS do not apply: Serve's `http_options` and replicas do that.

gRPC: Serve's gRPC proxy (`grpc_options` of the Serve config, `GRPC_SERVICER`) calls the deployment's method of
each RPC's name with the request message; each runs the servicer of `python -m service`'s gRPC server
(service.grpc.server.Servicer) over the replica's dataplane. ModelStreamInfer and grpc.health.v1 are not served
here (the first answers UNIMPLEMENTED): Serve's proxy has its own health calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import ray
from ray import serve
from starlette.types import Message, Receive, Scope, Send

from service.asgi import without_shared_memory
from service.config import Settings, get_settings
from service.core.logs import configure_logging
from service.grpc.guard import refuse
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proxied import Refused
from service.grpc.server import Servicer
from service.http.app import AttendApp, create_app

# For the Serve config's grpc_options.grpc_servicer_functions: the service's RPCs on Serve's gRPC proxy.
GRPC_SERVICER = "service.grpc.proxied.add_servicer"
# The unary RPCs of the servicer, each a method of the deployment (Serve's proxy calls them by name).
GRPC_CALLS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
              "ModelStatistics", "ModelInfer", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
              "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
              "LogSettings", "TraceSetting")

# Sized for the batching: a replica merges only the requests Serve lets it hold at once (Serve's default
# is 5), so it may hold a full batch of one-row requests (ATTEND_MAX_BATCH_ROWS' default). Fewer than
# ATTEND_MAX_QUEUE, so the app's own queue never refuses what Serve sent it; beyond that, requests wait in
# Serve (at most MAX_QUEUED, then 503, as the app answers a full queue).
MAX_ONGOING = 64
MAX_QUEUED = 256
GRACE_S = Settings.model_fields["grace_period_s"].default


def replica_settings() -> Settings:
    """ATTEND_* of the replica's environment; the thread counts that default to "the cores this process
    may use" become the CPUs Ray gave the replica (`ray_actor_options.num_cpus`), not the node's cores,
    which every replica on the node would otherwise take for its own."""
    settings = get_settings()
    cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
    if cpus >= 1:
        settings = settings.model_copy(update={
            "intra_op_threads": settings.intra_op_threads or cpus,
            "inference_threads": settings.inference_threads or min(2, cpus)})
    return settings


class _OneRequestId:
    """The app, less its own `X-Request-ID` response header: Serve's HTTP servers (the proxy, or the
    replica's own under direct ingress) put the ID into the request before the app sees it and add
    it to the response themselves, so the app's would be a second copy of the same header (which
    clients join into "id, id"). Everything else, and the lifespan, is the app's."""

    def __init__(self, app: AttendApp):
        self.app = app

    def __getattr__(self, name: str) -> Any:  # add_exception_handler, state, ...: Serve and tests use the app's
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [h for h in message.get("headers", ()) if h[0] != b"x-request-id"]
            await send(message)

        await self.app(scope, receive, send_once)


def build_app() -> _OneRequestId:
    """The app of one replica (called by Serve in the replica, never in the driver: the app holds
    sessions, threads and a metrics registry, none of which could be pickled there and shipped)."""
    settings = replica_settings()
    configure_logging(settings.log_level)
    settings = without_shared_memory(settings, "Ray Serve")
    # The batching's load hint is the dataplane's own: Serve sends a replica requests one by one, so
    # those in flight are all a batch can wait for.
    return _OneRequestId(create_app(settings))


class _Context:
    """Serve's gRPC context (RayServegRPCContext) as the servicer reads grpc.aio's: the deadline is the proxy's
    (its request_timeout_s, the client's own), so none here; code, details and trailing metadata go back."""

    def __init__(self, context: Any):
        self.context = context

    def __getattr__(self, name: str) -> Any:  # invocation_metadata, peer, set_code, set_details, ...
        return getattr(self.context, name)

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:  # Serve's takes a list (and adds its request_id)
        self.context.set_trailing_metadata(list(metadata))


def _grpc_call(name: str) -> Any:
    """The deployment's method for RPC `name`: the servicer's, with Serve's context; an empty answer where it
    refused (the status is on the context)."""
    empty = getattr(pb, f"{name}Response")

    async def call(self: Any, request: Any, grpc_context: Any) -> Any:
        if isinstance(request, Refused):
            refuse(_Context(grpc_context), name, request.error)
            return empty()
        answer = await getattr(self.servicer(), name)(request, _Context(grpc_context))
        return answer if answer is not None else empty()

    call.__name__ = call.__qualname__ = name
    return call


# A method of each RPC's name, for Serve's gRPC proxy (`servicer()` is the deployment's).
_GrpcCalls = type("_GrpcCalls", (), {name: _grpc_call(name) for name in GRPC_CALLS})


@serve.deployment(max_ongoing_requests=MAX_ONGOING, max_queued_requests=MAX_QUEUED,
                  graceful_shutdown_timeout_s=GRACE_S, ray_actor_options={"num_cpus": 1})
@serve.ingress(build_app)
class Attend(_GrpcCalls):
    """One replica of the service: `build_app`'s app; Serve calls it with each HTTP request, and its method
    of each RPC's name with each gRPC call (GRPC_CALLS)."""

    _servicer: Servicer | None = None

    def servicer(self) -> Servicer:
        """The gRPC servicer over the replica's dataplane (made at the first call: the app has started)."""
        if self._servicer is None:
            app = self.app.app  # _OneRequestId's AttendApp
            self._servicer = Servicer(app.state.dataplane, app.state.settings, app.version)
        return self._servicer

    async def ModelStreamInfer(self, requests: Any, grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """Not served here (its answers in the order they finish need the servicer's own stream): UNIMPLEMENTED,
        saying what to use, rather than Serve's error for a method the deployment lacks."""
        details = "ModelStreamInfer is not served through Ray Serve: send each request as a ModelInfer call"
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details(details)
        raise NotImplementedError(details)  # a stream's status goes out only so (Serve's gRPCStatusError)
        yield


# `serve run service.serve:app`, or the import_path of deploy/ray/serve.yaml.
app = Attend.bind()
