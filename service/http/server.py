"""uvicorn's server, as the service runs it: `GracefulServer` adds readiness and SIGTERM handling
(see service/__main__.py); `run_workers` runs it in every worker process of ATTEND_WORKERS."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import logging
import multiprocessing
import os
import resource
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import multiprocess as metrics_files
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

from service.config import Settings
from service.core.dataplane import load_registry
from service.core.logs import configure_logging, flush_logs
from service.core.memory import libc
from service.core.metrics import fold_dead_worker
from service.core.runtime import StartupError
from service.http.accept import BalancedListener, Shares
from service.http.guard import Guard
from service.http.protocol import GuardedProtocol

log = logging.getLogger("service")
# After SIGTERM: the listener stays open this long, then accepted connections get at most
# _SETTLE_S to show their first request.
_ACCEPT_S = 0.5


_SETTLE_S = 1.0
# Then the listener takes no new handshake, and those under way have this long to complete (one round
# trip: microseconds on this machine, a millisecond or two across a data centre).
_HANDSHAKE_S = 0.05


class GracefulServer(uvicorn.Server):
    """uvicorn stops accepting connections on SIGTERM and waits for the open ones; this turns
    readiness off first, so a load balancer's probe and requests already on a kept-alive
    connection see 503 at once rather than a half-stopped service."""

    def __init__(self, config: uvicorn.Config, app: Any = None):
        super().__init__(config)
        self._app = app

    @property
    def app(self) -> Any:
        """The service's app: given, or (in a worker) the one uvicorn's factory made."""
        return self._app if self._app is not None else getattr(self.config, "loaded_app", None)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # The connections' limits, from the settings the app was built with (not the environment's);
        # its refusals counted in the app's metrics.
        state = self.app.state  # type: ignore[attr-defined]
        self.config.attend_guard = guard = Guard(state.settings, state.dataplane.metrics)
        # A worker of several accepts its share of the connections (service.http.accept), not uvloop.
        shares = getattr(self.config, "attend_shares", None)
        balanced = bool(sockets) and shares is not None and shares.claim()
        await super().startup([] if balanced else sockets)
        if self.started and balanced:
            guard.shares = shares
            self.servers = [BalancedListener(s, self._protocol, shares, guard.protocols.__len__, self.config.backlog)
                            for s in sockets or ()]
        if self.started:
            # The requests in progress (uvicorn's own set) and the connections with a client busy
            # sending requests: the batching reads how many.
            self.app.state.dataplane.set_load_hint(self.server_state.tasks, guard.busy)
            # SIGHUP: load every model whose newest version changed (uvicorn does not handle it, and
            # its default action would end the process). Signals reach the main thread only.
            if threading.current_thread() is threading.main_thread():
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload)
                # Until now SIGHUP was ignored (service.__main__, Worker.target), and the repository read: catch
                # up with what changed since (a version exported, a model unloaded through another worker).
                self.app.state.dataplane.reload_changed(signalled=False)
            # What the process holds now (the modules, the models) lives as long as it does: out of the
            # garbage collector's sight, so that a full collection under load looks only at what came
            # after, and stays short (`python bench/gc_cost.py` times them). A model loaded or unloaded
            # later puts it back (ModelControl), so that a replaced snapshot's cycles, if it has any, are
            # still collected.
            gc.collect()
            gc.freeze()
            loop = type(asyncio.get_running_loop())
            log.info("serving on %s/ (the page; API docs: %s/docs); uvicorn on %s.%s with %s",
                     *[serving_url(self)] * 2, loop.__module__, loop.__qualname__,
                     self.config.http_protocol_class.__name__)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Readiness is off already. Keep accepting a moment first: connections whose handshake
        # the kernel finished before the signal wait in the accept queue with their request sent,
        # and closing the listener would reset them (the event loop may not have had the GIL to
        # accept them: a large body's decode holds it while it parses).
        await asyncio.sleep(_ACCEPT_S)
        # Then stop accepting and, before uvicorn closes every connection that has no request
        # under way, let the accepted ones have their request parsed, for the same reason.
        loop = asyncio.get_running_loop()
        listeners = [socket.socket(fileno=os.dup(s.fileno())) for server in self.servers
                     for s in (server.sockets or ())]
        # The last copy of a listening socket to close resets the connections in its accept queue:
        # each had connected and sent its request, and would be lost unanswered. So the listener
        # first answers no new handshake (the client's SYN dropped: it sends it again a second later
        # and finds the port closed), the handshakes under way complete, and the queue is taken in
        # one go before the close. Without the first step, a connection could still come between
        # an empty accept() and close(): milliseconds when another thread holds the GIL (CI once
        # reset a client of test_workers ~0.6 s after SIGTERM; `python bench/sigterm_drops.py`).
        refusing = [refuse_handshakes(listener) for listener in listeners]  # each of them, not any()'s first
        if any(refusing):
            await asyncio.sleep(_HANDSHAKE_S)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for listener in listeners:
            accepted = []
            listener.setblocking(False)
            try:
                while True:
                    accepted.append(listener.accept()[0])
            except OSError:  # BlockingIOError: the queue is empty
                pass
            listener.close()
            for connection in accepted:
                await loop.connect_accepted_socket(self._protocol, connection)
        settle_until = loop.time() + _SETTLE_S
        while loop.time() < settle_until and any(
            getattr(c, "cycle", None) is None for c in list(self.server_state.connections)
        ):
            await asyncio.sleep(0.01)
        await super().shutdown(sockets)
        flush_logs()  # uvicorn re-raises the signal next, and a process ended by a signal skips atexit

    def _protocol(self) -> asyncio.Protocol:
        """A connection's protocol, as uvicorn's startup makes them."""
        return self.config.http_protocol_class(config=self.config, server_state=self.server_state,  # type: ignore
                                               app_state=self.lifespan.state)

    def _reload(self) -> None:
        self.app.state.dataplane.reload_changed()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler (uvicorn's signal.signal): Python runs it in the main thread between two
        # bytecodes of whatever the event loop was doing, so it must take no lock that code can hold.
        # prometheus_client's locks are not reentrant (with workers, one lock for every metric): the
        # readiness gauge set here, while the loop was counting a request, hung a worker for good
        # (test_workers, SIGTERM under load). The readiness and the log line are the loop's next turn;
        # uvicorn's own part sets two attributes.
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self._stop_accepting, sig)
        except RuntimeError:  # not serving (yet, or any more): nothing to turn off
            pass
        super().handle_exit(sig, frame)

    def _stop_accepting(self, sig: int) -> None:
        dataplane = getattr(getattr(self.app, "state", None), "dataplane", None)
        if dataplane is not None and dataplane.ready:
            log.info("signal %d: not ready; finishing %d requests in flight", sig, dataplane.in_flight)
            dataplane.stop_accepting()


# A classic BPF program for a TCP socket (it sees the TCP header): drop a segment with SYN set, keep
# the rest. On a listener, new handshakes go unanswered; those already under way complete.
_DROP_SYN = b"".join(struct.pack("HBBI", *insn) for insn in (
    (0x30, 0, 0, 13),  # ldb [13]: the flags byte
    (0x45, 0, 1, 0x02),  # jset #SYN: next, else skip one
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: keep
))
_SO_ATTACH_FILTER = 26


def refuse_handshakes(listener: socket.socket) -> bool:
    """Make the listening socket `listener` answer no new connection (Linux: a socket filter that
    drops SYNs), so that it can be emptied and closed without resetting a connection the kernel
    completed in between. False where this cannot be done (another system)."""
    if sys.platform != "linux":
        return False
    program = ctypes.create_string_buffer(_DROP_SYN, len(_DROP_SYN))
    fprog = struct.pack("HL", len(_DROP_SYN) // 8, ctypes.addressof(program))  # struct sock_fprog
    try:
        listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


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


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    # Our access log (service.access) carries the request ID; uvicorn's would repeat it without.
    # proxy_headers off: X-Forwarded-For would only rewrite the client address, which nothing here
    # reads, and its middleware is a layer every request passes. The connection limit is the
    # guarded protocol's (health probes exempt), not uvicorn's.
    return {"host": settings.host, "port": settings.port, "log_config": None, "access_log": False,
            "proxy_headers": False, "http": GuardedProtocol, "timeout_graceful_shutdown": settings.grace_period_s,
            "timeout_keep_alive": settings.keep_alive_s, "limit_concurrency": None, "backlog": 4096}


_SPAWN_BLOCKS = {signal.SIGHUP, signal.SIGTERM, signal.SIGINT}  # held while the supervisor starts a worker


class Worker(multiprocess.Process):
    """A worker of ATTEND_WORKERS: a GracefulServer (module level: the spawned process unpickles it)."""

    # SIGHUP's default action ends a process: one that reached a worker still starting (a load through another
    # worker, an operator's SIGHUP) ended it, and its replacement in turn. So it comes blocked, as the
    # supervisor spawns it (Supervisor._spawn; the mask is inherited from the first instruction), and the worker
    # ignores it until its server handles it, then catches up with the repository (GracefulServer.startup).
    def target(self, sockets: list[socket.socket] | None = None) -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # One that came meanwhile: SIGHUP dropped; SIGTERM and SIGINT end it.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SPAWN_BLOCKS)
        _stopped_with_the_supervisor()
        super().target(sockets)

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = GracefulServer(config=self.config)
        return self._server


def _stopped_with_the_supervisor() -> None:
    """A worker whose supervisor ended without stopping it (SIGKILL, a crash) served on for good, holding the
    port a new start needs; the start's check loaded on, for nothing. On Linux the kernel now sends either
    SIGTERM then (PR_SET_PDEATHSIG): a worker drains and exits as on the supervisor's. One whose supervisor is
    gone already ends now."""
    prctl = getattr(libc(), "prctl", None)
    if prctl is not None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    supervisor = multiprocessing.parent_process()
    if supervisor is not None and os.getppid() != supervisor.pid:
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor handles a signal in its loop, up to 0.5 s later, and keeps the
    listening socket open until it exits: the kernel kept completing connections that no worker
    would accept, and reset them at the end (requests sent just after SIGTERM were dropped). Here
    SIGTERM and SIGINT reach the workers at once, as SIGTERM: each turns readiness off, keeps
    accepting for a moment, then closes its copy; the supervisor closes its own copy at once.
    SIGHUP goes to the workers too: each loads what changed (uvicorn's default restarts them all). A
    worker that dies is replaced (as uvicorn's loop does; not once SIGTERM came), logged, and its live gauges
    leave /metrics. A replacement that cannot start is tried again, less and less often, while the others
    serve; a worker of the start that cannot start stops the service, as does the last replacement failing."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stopping = False
        self.start_failed = False  # a worker of the start could not start: the service stops, exit code 1
        self._replacing: dict[int, float] = {}  # slot -> seconds its replacement waits if it cannot start
        self._retry_at: dict[int, float] = {}  # slot -> when to try again, while it waits
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        if not self._stopping:
            self._stopping = True
            # SIGTERM even for SIGINT: a terminal's Ctrl-C reaches the workers as well, and a
            # second SIGINT makes uvicorn end at once, in-flight requests with it.
            self._forward(signal.SIGTERM)
            for sock in self.sockets:
                sock.close()
        # uvicorn's loop takes it from the queue (handle_term, handle_int: should_exit), within 0.5 s.
        # Not should_exit.set() here: that takes the lock of the Event the loop waits on, which its
        # own thread, interrupted by this handler, can be holding.
        self.signal_queue.append(sig)

    def init_processes(self) -> None:
        for _ in range(self.processes_num):
            self._spawn()

    def keep_subprocess_alive(self) -> None:
        """uvicorn's, but no worker is started once SIGTERM came. Its handler can come while uvicorn's waits on a
        worker's answer (up to 5 s): a worker that then ended (SIGTERM while it started) was replaced, over the
        sockets the handler had closed, and the supervisor ended in a traceback."""
        for idx, old in enumerate(self.processes):
            if self._stopping or self.should_exit.is_set():
                return
            if idx in self._retry_at:  # its replacement could not start: the next try, when its time comes
                if time.monotonic() >= self._retry_at[idx]:
                    new = self._spawn(idx)
                    if new is None:
                        return
                    del self._retry_at[idx]
                    log.info("worker %d started, to try again", new.pid)
                continue
            if old.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            old.kill()  # hung, or gone
            old.join()
            self._gone(old)
            code = old.exitcode
            if code == STARTUP_FAILURE and idx not in self._replacing:  # the start's: every worker would fail alike
                self._give_up("cannot start: worker %d could not (its lines above say why); stopping", old.pid)
                return
            if code == STARTUP_FAILURE:  # a replacement (the repository moved, the GPU full): the others serve on
                delay = self._replacing[idx]
                self._replacing[idx] = min(2 * delay, 60.0)
                self._retry_at[idx] = time.monotonic() + delay
                serving = self.processes_num - len(self._retry_at)
                if not serving:  # nothing left to serve: stop, as a start would
                    self._give_up("no worker could start in place of those that ended (their lines above say why); "
                                  "stopping")
                    return
                log.error("worker %d could not start in place of one that ended (its lines above say why); next try in "
                          "%.0f s; %d of %d workers serve", old.pid, delay, serving, self.processes_num)
                continue
            self._replacing[idx] = 1.0
            new = self._spawn(idx)
            if new is None:
                return
            log.error("worker %d ended (%s); worker %d started in its place", old.pid,
                      f"signal {-code}" if code is not None and code < 0 else f"exit code {code}", new.pid)

    def _give_up(self, message: str, *args: Any) -> None:
        """Stop the service, exit code 1 (run_workers' False)."""
        log.critical(message, *args)
        self.start_failed = True
        self.should_exit.set()

    def _gone(self, old: multiprocess.Process) -> None:
        """A worker gone leaves its live gauges' files: /metrics would go on counting its requests in flight and
        listing its pid. Its counters go into the files of the dead (the totals hold what it served)."""
        metrics_files.mark_process_dead(old.pid)
        try:
            fold_dead_worker(old.pid)
        except OSError as e:  # a full disk: its files stay, as they did, and the supervisor goes on
            log.warning("could not fold worker %d's metrics into the dead workers' files: %s", old.pid, e)
        shares = getattr(self.config, "attend_shares", None)
        if shares is not None:  # nor the others count its connections while its replacement starts
            shares.release(old.pid)

    def _spawn(self, idx: int | None = None) -> multiprocess.Process | None:
        """A new worker, appended or at `idx`, unless SIGTERM came: the handler, held off meanwhile, then finds
        it among the workers it stops. None once stopping. (SIGHUP held off: Worker.)"""
        with _signals_blocked(*_SPAWN_BLOCKS):
            if self._stopping:
                return None
            process = multiprocess.Process(self.config, self.sockets)
            process.start()
            if idx is None:
                self.processes.append(process)
            else:
                self.processes[idx] = process
        return process

    def _forward(self, sig: int) -> None:
        for process in self.processes:
            if process.process.exitcode is None and process.process.pid is not None:
                os.kill(process.process.pid, sig)

    def terminate_all(self) -> None:
        if not self._stopping:  # the loop ended otherwise (a worker that failed to start)
            super().terminate_all()

    def handle_hup(self) -> None:
        log.info("SIGHUP: passed to %d workers", len(self.processes))
        self._forward(signal.SIGHUP)


def bind_port(host: str, port: int, setting: str, what: str, fix: str = "") -> socket.socket:
    """A socket bound to (host, port) and not listening yet (a client is refused until the server listens),
    or StartupError in one line that names the setting to change. Bound without SO_REUSEPORT, so that a port
    another process holds with it (another service's gRPC) counts as taken too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            setting, fix = "ATTEND_HOST", "ATTEND_HOST must be an address of this machine (0.0.0.0: all of them)"
        else:
            fix = f"set {setting} to a free port{fix}"
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise StartupError(f"cannot serve {what} on {address} ({setting}): {e.strerror or e}; {fix}") from None
    sock.set_inheritable(True)  # uvicorn's workers take it (config.bind_socket does the same)
    return sock


def scratch_dir(what: str) -> str | None:
    """Where this run's own folders go (`what` they hold, for the error): the temporary folder (TMPDIR, /tmp;
    None), or /dev/shm where none is writable, as on a read-only root filesystem."""
    try:
        tempfile.gettempdir()
        return None
    except FileNotFoundError:  # tempfile found no writable folder
        if os.access("/dev/shm", os.W_OK | os.X_OK):
            return "/dev/shm"
        raise StartupError(f"ATTEND_WORKERS > 1 needs a writable folder for {what}: TMPDIR, /tmp or /dev/shm") from None


def run_workers(settings: Settings, factory: str | Callable[[], Any], listener: socket.socket) -> bool:
    """ATTEND_WORKERS processes behind `listener` (bind_port's), each a GracefulServer with the app `factory` makes
    (its own sessions; an import string, or a callable the spawned workers unpickle), the metrics of all of
    them on every /metrics (prometheus_client's multiprocess mode, in a folder of this run's own). False: a worker
    could not start."""
    metrics_dir = tempfile.mkdtemp(prefix="attend-metrics-", dir=scratch_dir("the metrics"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir

    config = uvicorn.Config(factory, factory=True, workers=settings.workers,
                            **uvicorn_options(settings))
    config.attend_shares = Shares(settings.workers)  # type: ignore[attr-defined]
    # uvicorn's supervisor makes its workers with its module's Process: ours, while it runs.
    process, multiprocess.Process = multiprocess.Process, Worker  # type: ignore[misc]
    try:
        supervisor = Supervisor(config, sockets=[listener])
        supervisor.run()
        return not supervisor.start_failed
    finally:
        multiprocess.Process = process  # type: ignore[misc]
        for name in os.listdir(metrics_dir):
            os.unlink(os.path.join(metrics_dir, name))
        os.rmdir(metrics_dir)


def check_in_a_process(settings: Settings, timings_folder: str) -> None:
    """ATTEND_WORKERS > 1: the repository loaded as a worker will load it, in a process of its own that is gone
    before the workers start (StartupError: why it cannot be served). Loaded in the supervisor, the sessions
    would leave it CUDA's context (hundreds of MB of GPU memory) for as long as it runs, serving nothing.
    It times the graphs (ATTEND_GRAPH_TIMING_S) with nothing else running, and leaves their times in
    `timings_folder` for every worker to take (service.core.choice.SharedTimings). SIGTERM or SIGINT meanwhile
    (exit_on_stop_signals) ends it too: the process pool's worker it ran in outlived the supervisor for good."""
    context = multiprocessing.get_context("spawn")
    try:  # the workers' shares (service.http.accept) take POSIX semaphores: say so now
        context.Lock()
    except OSError as e:
        raise StartupError(f"ATTEND_WORKERS={settings.workers} needs a writable /dev/shm (POSIX shared memory): "
                           f"{e.strerror}") from None
    receive, send = context.Pipe(duplex=False)
    check = context.Process(target=_load, args=(settings, timings_folder, send), name="attend-check")
    try:
        # Held while it starts, then delivered here: SIGTERM midway through start() left it reading arguments half
        # written (an EOFError traceback in the log, CI at 4c45674), with no pid to end it by. _load unblocks them.
        with _signals_blocked(signal.SIGTERM, signal.SIGINT):
            check.start()
        send.close()
        try:
            failure = receive.recv()
        except EOFError:  # it died without a word
            failure = None
        check.join()  # it ends once it has answered, its log written
    except BaseException:  # SIGTERM, SIGINT (exit_on_stop_signals): it goes too
        if check.pid is not None:
            check.terminate()
            check.join()
        raise
    if failure is None:
        failure = f"the check of the repository ended with exit code {check.exitcode}"
    if failure:
        raise StartupError(failure)


# The stop signals exit_on_stop_signals' handler took while _signals_blocked held them; None when not held.
_held: list[int] | None = None


@contextlib.contextmanager
def _signals_blocked(*signals: int) -> Iterator[None]:
    """The signals held until the block ends (then delivered); a process started meanwhile inherits the mask.
    The mask is this thread's: a process-directed signal can land on another thread (the log flusher's), and
    Python runs its handler here all the same, so exit_on_stop_signals' handler waits for the block's end too."""
    global _held
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    _held = []
    try:
        yield
    finally:
        came, _held = _held, None
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if came:
            raise SystemExit(128 + came[0])


@contextlib.contextmanager
def exit_on_stop_signals() -> Iterator[None]:
    """SIGTERM or SIGINT raise SystemExit(128 + the signal) in the block (the start, before the server's handlers):
    what it started ends and the start's folder goes on the way out (the signals' default action left both
    behind, and as a container's PID 1 the process ignores them: `docker stop` waited its 10 s for SIGKILL)."""
    def stop(sig: int, frame: FrameType | None) -> None:
        if _held is not None:  # a start under way (_signals_blocked): it raises once the start is done
            _held.append(sig)
            return
        raise SystemExit(128 + sig)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _load(settings: Settings, timings_folder: str, send: Any) -> None:
    """Every model of the repository loaded, then let go: sends why not, or "" (check_in_a_process's process)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # blocked as it was spawned
    _stopped_with_the_supervisor()
    configure_logging(settings.log_level)
    try:
        load_registry(settings, timings_folder)
        send.send("")
    except StartupError as e:
        send.send(str(e))


# File descriptors a process holds besides its connections: sessions, logs, pipes, the event loop (16 idle).
_OWN_FILES = 64


def raise_file_limit(settings: Settings) -> None:
    """Open connections are file descriptors: the soft limit up to the hard one (often 1024 of 1M), and a warning
    where that is short of what ATTEND_MAX_OPEN_CONNECTIONS lets in (HTTP's, and as many gRPC's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    needed = settings.max_open_connections * (2 if settings.grpc_port else 1) + _OWN_FILES
    if hard != resource.RLIM_INFINITY and hard < needed:
        # Past the limit uvloop closes a new connection unanswered and says nothing; grpc leaves it waiting.
        log.warning("this process may open %d files (ulimit -n) and ATTEND_MAX_OPEN_CONNECTIONS=%d%s needs up to %d: "
                    "past the limit a new connection is closed unanswered (HTTP) or waits (gRPC); raise it "
                    "(docker run --ulimit nofile=N) or lower the setting", hard, settings.max_open_connections,
                    " (HTTP and gRPC)" if settings.grpc_port else "", needed)
