"""The service as a plain ASGI application, for any ASGI server:

    uvicorn --factory service.asgi:create_app --host 0.0.0.0 --port 8000

The same API, settings (ATTEND_*, read from the environment), models, checks, batching and metrics as
`python -m service`. What only `python -m service` adds is its own HTTP protocol and process
(service.http.protocol, service.http.server): the connection guard (header and body timeouts,
requests and connections at once, the in-flight budget counted before a body is read), responses
written in one system call, bodies written into one aligned buffer, SIGHUP reloads, ATTEND_WORKERS
and the graceful stop; under another server each falls back to plain ASGI
(service.http.extensions) and that server's own settings apply (ATTEND_HOST, ATTEND_PORT and
ATTEND_WORKERS do not), and so is gRPC (ATTEND_GRPC_PORT): `create_app` serves HTTP alone,
`create_worker_app` is `python -m service`'s worker with gRPC beside it.
"""

from __future__ import annotations

import logging
import sys

from uvicorn.config import STARTUP_FAILURE

from service.config import Settings, get_settings
from service.core.dataplane import load_registry
from service.core.logs import configure_logging
from service.core.runtime import StartupError
from service.grpc.server import GRPCServer
from service.http.app import AttendApp
from service.http.app import create_app as _create_app

log = logging.getLogger("service")


def create_app() -> AttendApp:
    """The app, with the settings of the environment: a factory for `uvicorn --factory` (and any server
    that calls one; every worker process calls it again)."""
    return _create_app(without_shared_memory(_new_process(), "uvicorn --factory"))


def without_shared_memory(settings: Settings, server: str) -> Settings:
    """System shared memory is `python -m service`'s: under another server each process would hold regions
    of its own, which a client's next request, sent to another, would not find."""
    if not settings.shared_memory:
        return settings
    log.warning("ATTEND_SHARED_MEMORY=true is for python -m service; under %s it is off (each process would have "
                "regions of its own)", server)
    return settings.model_copy(update={"shared_memory": False})


def _new_process() -> Settings:
    """The environment's settings, this process's logs and memory set by them (a worker is a new process: the
    parent's handlers are not there)."""
    settings = get_settings()
    configure_logging(settings.log_level)
    return settings


def create_worker_app(timings_folder: str | None = None) -> AttendApp:
    """A worker of `python -m service` with ATTEND_WORKERS > 1: the app, and gRPC beside it on
    ATTEND_GRPC_PORT, the port shared with the other workers (SO_REUSEPORT). `timings_folder`: where the
    start's check and the workers share the graphs' times (service.core.choice.SharedTimings).
    The models load here, before the app: one that cannot be served (the repository changed since the start's
    check; out of GPU memory) ends the worker with one line and uvicorn's STARTUP_FAILURE, which stops the
    start (a failed lifespan logged a traceback, and the service exited 0)."""
    settings = _new_process()
    try:
        registry = load_registry(settings, timings_folder)
    except StartupError as e:
        log.critical("cannot start: %s", e)
        sys.exit(STARTUP_FAILURE)
    app = _create_app(settings, registry, timings_folder)
    with_grpc(app, settings, shared_port=True)
    return app


def with_grpc(app: AttendApp, settings: Settings, shared_port: bool = False) -> AttendApp:
    """The app with the gRPC front door (service.grpc.server) among its core's transports, where
    ATTEND_GRPC_PORT is not 0: the app's lifespan starts it with the core and drains it with HTTP."""
    if settings.grpc_port:
        app.state.dataplane.transports.append(GRPCServer(settings, app.version, shared_port))
    return app
