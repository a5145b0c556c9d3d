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
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from starlette.types import Message, Receive, Scope, Send

from service.asgi import without_shared_memory
from service.config import Settings, get_settings
from service.core.logs import configure_logging
from service.http.app import AttendApp, create_app

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


@serve.deployment(max_ongoing_requests=MAX_ONGOING, max_queued_requests=MAX_QUEUED,
                  graceful_shutdown_timeout_s=GRACE_S, ray_actor_options={"num_cpus": 1})
@serve.ingress(build_app)
class Attend:
    """One replica of the service: `build_app`'s app; Serve calls it with each HTTP request."""


# `serve run service.serve:app`, or the import_path of deploy/ray/serve.yaml.
app = Attend.bind()
