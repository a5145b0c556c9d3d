"""Start the real service process (`python -m service`) on a free port, for tests that talk HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# A prefix for a service whose event loop a test times (`running_service(prefix=AHEAD)`): ahead of the
# machine's other processes for the CPU (nice -10, where it may: as root), so that the test measures
# what the service's own work does to its loop, not what a busy machine does (a whole suite running
# beside it, or anything else at the same priority, stretched such gaps two- to five-fold).
AHEAD: tuple[str, ...] = ("nice", "-n", "-10") if os.geteuid() == 0 else ()


@contextlib.contextmanager
def uvicorn_in_thread(app, http, **config) -> Iterator[int]:
    """uvicorn serving `app` with the HTTP protocol class `http` (uvloop, no lifespan) in a thread
    of this process, on a free port; yields the port, stops the server afterwards."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, loop="uvloop",
                                           lifespan="off", log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start in time")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def limited_cgroup(v2: tuple[str, str], v1: tuple[str, str, str]) -> str | None:
    """A new cgroup with the limit given (v2's file and value, or v1's controller, file and value) that a
    process may be put in (root, a writable cgroup filesystem), or None. The caller removes it (rmdir)."""
    name = f"attend-test-{os.getpid()}"
    for folder, limit in ((f"/sys/fs/cgroup/{name}", v2), (f"/sys/fs/cgroup/{v1[0]}/{name}", v1[1:])):
        try:
            os.mkdir(folder)
        except OSError:
            continue
        if not os.path.exists(os.path.join(folder, "cgroup.procs")):  # a plain folder: no cgroup filesystem there
            os.rmdir(folder)
            continue
        try:
            with open(os.path.join(folder, limit[0]), "w") as f:
                f.write(limit[1])
            return folder
        except OSError:  # v2 without the controller: no such file
            os.rmdir(folder)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_service(repository: Path, timeout: float = 60.0, prefix: Sequence[str] = (), log_path: Path | None = None,
                    command: Sequence[str] | None = None, ready_path: str = "/health/ready",
                    stop_timeout: float = 20.0, starting: Callable[[subprocess.Popen], object] | None = None,
                    **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yield (base URL, process) once `ready_path` answers 200; stop the process afterwards.

    `prefix` goes before the command (e.g. `taskset -c 0`); `command` replaces `python -m service`,
    with `{port}` in it replaced by the port. The log goes to a file (`log_path`, or a temporary one),
    not a pipe nobody reads, which a long run would fill until the service blocks on it. A process still
    running `stop_timeout` seconds after the SIGTERM at the end is reported (`report_hung`) and killed.
    `starting` is called with the process as soon as it is started, before it is ready.
    """
    port = free_port()
    # gRPC off unless asked for (ATTEND_GRPC_PORT=<a free port>): two services on one machine would both
    # want its default port, 8001.
    environ = os.environ | {"ATTEND_PORT": str(port), "ATTEND_MODEL_REPOSITORY": str(repository),
                            "ATTEND_DEVICE": "cpu", "ATTEND_LOG_LEVEL": "warning",
                            "ATTEND_GRPC_PORT": os.environ.get("ATTEND_GRPC_PORT", "0")} | env
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile(mode="w+")
    argv = [a.replace("{port}", str(port)) for a in command] if command else [sys.executable, "-m", "service"]
    proc = subprocess.Popen([*prefix, *argv], cwd=ROOT, env=environ, stdout=subprocess.DEVNULL, stderr=log,
                            text=True)
    if starting is not None:
        starting(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the service exited with {proc.returncode}: {log.read()}")
            try:
                if httpx.get(f"{url}{ready_path}", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the service did not become ready in time")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                report_hung(proc, log)
                for pid in (*children(proc.pid), proc.pid):  # its workers too: they would outlive it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
        log.close()


def served_by_worker(text: str) -> dict[int, float]:
    """attend_worker_served of each live worker (ATTEND_WORKERS > 1), by pid."""
    return {int(pid): float(value) for pid, value in
            re.findall(r'^attend_worker_served\{pid="(\d+)"\} (\S+)', text, re.M)}


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat (PID/task/TID: one thread's) after the command (which may hold spaces
    and parentheses): state, parent's pid, ...; utime and stime are [11] and [12]. OSError where the
    process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """The processes `pid` started (a supervisor's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(proc_stat(entry.name)[1]) == pid:
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def graceful_in_thread(app) -> Iterator[tuple[Any, Any]]:
    """The service's own server (GracefulServer, at the settings `app` was built with, on the asyncio loop)
    serving `app` in a thread of this process: no signal handlers of its own (not the main thread). Yields
    (server, thread) once started; tells it to exit afterwards and waits for the thread (30 s at most)."""
    import threading

    import uvicorn

    from service.http.server import GracefulServer, uvicorn_options

    server = GracefulServer(uvicorn.Config(app, **uvicorn_options(app.state.settings) | {"loop": "asyncio"}), app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield server, thread
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def report_hung(proc: subprocess.Popen, log) -> None:
    """A service that did not stop on SIGTERM: every thread's stack of it and of its workers (py-spy),
    and the end of its log, on stderr, where the failing test's report shows them."""
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    for pid in (proc.pid, *children(proc.pid)):
        try:
            dump = subprocess.run([py_spy or "py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=30)
            stacks = dump.stdout or dump.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            stacks = f"(no stacks: {e})"
        print(f"--- process {pid}, still running after SIGTERM:\n{stacks}", file=sys.stderr)
    log.flush()
    log.seek(0)
    print(f"--- the end of its log:\n{log.read()[-6000:]}", file=sys.stderr)
