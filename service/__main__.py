"""`python -m service`: uvicorn with the settings of the environment (ATTEND_*).

The models are loaded before uvicorn starts, so a repository that cannot be served stops the
process with a one-line reason and exit code 1, before any port is open.

SIGHUP: every model whose newest version in the repository is not the one served is loaded and
swapped in (service.control); what is in flight finishes on the version it started on.

SIGTERM (and SIGINT): readiness turns 503 at once; the listener closes half a second later (new
connections are refused from then on); requests in flight and in the batch queue finish; then the
process exits, within ATTEND_GRACE_PERIOD_S.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.app import create_app, load_registry
from service.config import get_settings
from service.middleware import configure_logging, flush_logs
from service.runtime import StartupError

log = logging.getLogger("service")
# After SIGTERM: the listener stays open this long, then accepted connections get at most
# _SETTLE_S to show their first request.
_ACCEPT_S = 0.5
_SETTLE_S = 1.0


class GracefulServer(uvicorn.Server):
    """uvicorn stops accepting connections on SIGTERM and waits for the open ones; this turns
    readiness off first, so a load balancer's probe and requests already on a kept-alive
    connection see 503 at once rather than a half-stopped service."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # The requests in progress and the open connections (uvicorn's own sets): the batching
            # reads how many.
            self.app.state.dataplane.server_tasks = self.server_state.tasks
            self.app.state.scheduler.connections = self.server_state.connections
            # SIGHUP: load every model whose newest version changed (uvicorn does not handle it, and
            # its default action would end the process).
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload)
            loop = type(asyncio.get_running_loop())
            log.info("serving on %s/ (the page; API docs: %s/docs); uvicorn on %s.%s with %s",
                     *[serving_url(self)] * 2, loop.__module__, loop.__qualname__,
                     self.config.http_protocol_class.__name__)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Readiness is off already. Keep accepting a moment first: connections whose handshake
        # the kernel finished before the signal wait in the accept queue with their request sent,
        # and closing the listener would reset them (the event loop may not have had the GIL to
        # accept them: a large body's decode holds it for ~100 ms).
        await asyncio.sleep(_ACCEPT_S)
        # Then stop accepting and, before uvicorn closes every connection that has no request
        # under way, let the accepted ones have their request parsed, for the same reason.
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        loop = asyncio.get_running_loop()
        settle_until = loop.time() + _SETTLE_S
        while loop.time() < settle_until and any(
            getattr(c, "cycle", None) is None for c in list(self.server_state.connections)
        ):
            await asyncio.sleep(0.01)
        await super().shutdown(sockets)
        flush_logs()  # uvicorn re-raises the signal next, and a process ended by a signal skips atexit

    def _reload(self) -> None:
        state = self.app.state
        if state.ready:
            log.info("SIGHUP: loading the models whose newest version changed")
            state.scheduler.spawn(state.control.reload_changed())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.app.state.ready:
            log.info("signal %d: not ready; finishing %d requests in flight", sig,
                     self.app.state.dataplane.in_flight)
        self.app.state.ready = False
        self.app.state.metrics.ready.set(0)
        super().handle_exit(sig, frame)


def serving_url(server: uvicorn.Server) -> str:
    """Where a client on this machine reaches the server (the port really bound, when 0 was asked)."""
    host, port = server.config.host, server.config.port
    for listener in server.servers:
        for sock in listener.sockets:
            host, port = sock.getsockname()[:2]
            break
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main() -> int:
    settings = get_settings()
    configure_logging(settings.log_level)
    try:
        registry = load_registry(settings)
    except StartupError as e:
        log.critical("cannot start: %s", e)
        return 1
    # Our access log (service.access) carries the request ID; uvicorn's would repeat it without.
    # proxy_headers off: X-Forwarded-For would only rewrite the client address, which nothing here reads,
    # and its middleware is a layer every request passes.
    common = {"host": settings.host, "port": settings.port, "log_config": None, "access_log": False,
              "proxy_headers": False,
              "timeout_graceful_shutdown": settings.grace_period_s, "limit_concurrency": settings.max_connections}
    if settings.workers == 1:
        app = create_app(settings, registry)
        GracefulServer(uvicorn.Config(app, **common), app).run()
    else:
        # Each worker process loads its own sessions; the load above was the check. Workers
        # drain on SIGTERM as uvicorn does (readiness turns off in their lifespan shutdown).
        del registry
        uvicorn.run("service.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
