"""`python -m service` (and `attend serve`): uvicorn with the settings of the environment (ATTEND_*).
It takes no arguments but --help, which prints the settings and exits.

The ports are bound first and the models loaded before uvicorn starts: a port taken or a repository that
cannot be served stops the process with a one-line reason and exit code 1, before a client is accepted.

SIGHUP: every model whose newest version in the repository is not the one served is loaded and
swapped in (service.core.control); what is in flight finishes on the version it started on. One while
the models load is ignored, and the server does the same once it handles SIGHUP.

gRPC (Triton's GRPCInferenceService, service.grpc.server) is served beside HTTP on ATTEND_GRPC_PORT
(8001; 0: off), by the same process and core; with ATTEND_WORKERS > 1 by every worker, on one port.

SIGTERM (and SIGINT): readiness turns 503 at once; gRPC takes no new calls; the HTTP listener closes
half a second later (new connections are refused from then on); requests and calls in flight and in
the batch queue finish; then the process exits, within ATTEND_GRACE_PERIOD_S. ATTEND_WORKERS > 1: the
same in every worker (service.http.server.run_workers).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from service.asgi import create_worker_app, with_grpc
from service.config import (
    BUDGET_FACTOR,
    CUDA_IDLE_BYTES,
    IDLE_BYTES,
    Settings,
    UnknownSetting,
    get_settings,
    is_auto,
    memory_limit,
    usable_cores,
)
from service.core import tracing
from service.core.dataplane import load_registry
from service.core.gpu import MIN_BUDGET, SHARE, WORKER_BYTES, auto_workers, holds, total_memory
from service.core.logs import configure_logging
from service.core.runtime import StartupError
from service.http.app import create_app
from service.http.server import (
    GracefulServer,
    bind_port,
    check_in_a_process,
    exit_on_stop_signals,
    raise_file_limit,
    run_workers,
    scratch_dir,
    uvicorn_options,
)

log = logging.getLogger("service")


def parser(prog: str = "python -m service") -> argparse.ArgumentParser:
    """The command line: no arguments (the settings are ATTEND_* variables), --help lists them."""
    return argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve every model of the repository (ATTEND_MODEL_REPOSITORY) over HTTP (and gRPC, on\n"
        "ATTEND_GRPC_PORT; 0 turns it off) through ONNX Runtime.\n"
        "Settings are ATTEND_* environment variables (docs/settings.md says what each does); an\n"
        "unknown ATTEND_* variable stops the start. To listen beyond localhost: ATTEND_HOST=0.0.0.0.\n"
        "SIGTERM drains and exits; SIGHUP loads the models whose newest version changed.",
        epilog="settings (default):\n" + _settings_table(),
    )


def _settings_table(width: int = 48) -> str:
    """Every setting with its default, two a line."""
    cells = []
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, bool):
            default = str(default).lower()
        shown = "(none)" if name.endswith("_keys") or default == "" else default  # the keys are SecretStr
        cells.append(f"ATTEND_{name.upper()}={shown}")
    rows = [cells[i:i + 2] for i in range(0, len(cells), 2)]
    return "\n".join("  " + "".join(cell.ljust(width) for cell in row).rstrip() for row in rows)


def main(argv: Sequence[str] | None = None, prog: str = "python -m service") -> int:
    parser(prog).parse_args(argv)  # --help exits 0 here, anything else 2, before a setting is read
    # SIGHUP's default action ends a process: one while it starts (an operator's, after an export) is ignored;
    # the server catches up with the repository once it handles SIGHUP (GracefulServer.startup).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        settings = get_settings()
        tracing.read_environment()  # OTEL_*: a value the SDK would only warn about stops the start
    except (UnknownSetting, ValidationError, tracing.TracingError) as e:  # one line, before anything else
        print(f"cannot start: {_one_line(e)}", file=sys.stderr)
        return 1
    configure_logging(settings.log_level)
    gpu = None if settings.device == "cpu" else total_memory(None)
    if is_auto(os.environ.get("ATTEND_WORKERS")):
        os.environ["ATTEND_WORKERS"] = str(settings.workers)  # the start's check and the workers read the number
        log.info("ATTEND_WORKERS=auto: %d workers (%d usable cores%s)", settings.workers, usable_cores(),
                 "" if gpu is None else f"; a GPU of {gpu / 2**30:.1f} GiB")
    threads = settings.resolved_intra_op_threads()
    if settings.intra_op_threads > threads:
        log.warning("ATTEND_INTRA_OP_THREADS=%d is more than the cores this process may use (%d): %d threads a run",
                    settings.intra_op_threads, threads, threads)
    if settings.workers > usable_cores():
        log.warning("ATTEND_WORKERS=%d is more than the cores this process may use (%d): the workers take turns on "
                    "them, each holding every model", settings.workers, usable_cores())
    _warn_of_the_memory_limit(settings)
    _warn_of_the_gpu_memory(settings, gpu)
    with contextlib.ExitStack() as folders:
        try:
            with exit_on_stop_signals():  # the loads take seconds; then the server's own handlers take over
                # A port taken stops the start now, in one line, not once the models are loaded. HTTP's socket is
                # kept (bound, listened on once the server starts); gRPC's checked (grpcio binds its own).
                listener = bind_port(settings.host, settings.port, "ATTEND_PORT", "HTTP")
                if settings.grpc_port:
                    bind_port(settings.host, settings.grpc_port, "ATTEND_GRPC_PORT", "gRPC",
                              ", or 0 to turn gRPC off").close()
                if settings.workers == 1:
                    registry = load_registry(settings)
                else:
                    # The start's check and every worker share the graphs' times in a folder of the start's own.
                    timings_folder = folders.enter_context(tempfile.TemporaryDirectory(
                        prefix="attend-timings-", dir=scratch_dir("the graphs' times")))
                    check_in_a_process(settings, timings_folder)  # then each worker loads its own sessions
        except StartupError as e:
            log.critical("cannot start: %s", e)
            return 1
        raise_file_limit(settings)
        if settings.workers == 1:
            app = with_grpc(create_app(settings, registry), settings)
            GracefulServer(uvicorn.Config(app, **uvicorn_options(settings)), app).run([listener])
        else:
            if not run_workers(settings, functools.partial(create_worker_app, timings_folder), listener):
                return 1
    return 0


def _warn_of_the_memory_limit(settings: Settings) -> None:
    """Past its cgroup's memory limit a process is killed, where the in-flight budget would have refused (503)."""
    limit = memory_limit()
    idle = CUDA_IDLE_BYTES if settings.device == "cuda" else IDLE_BYTES  # "auto" is not resolved yet
    need = settings.workers * (idle + BUDGET_FACTOR * settings.max_inflight_bytes)
    if limit is None or limit >= need:
        return
    mib = 2**20
    fits = (limit / settings.workers - idle) / BUDGET_FACTOR
    fix = (f"set ATTEND_MAX_INFLIGHT_BYTES to at most {int(fits)} ({fits / mib:.0f} MiB)" if fits >= 1024
           else "give it more memory, or fewer ATTEND_WORKERS")
    log.warning("the memory limit (%.0f MiB, the cgroup's) is less than ATTEND_WORKERS=%d x (%d MiB + %g x "
                "ATTEND_MAX_INFLIGHT_BYTES=%.0f MiB): requests in flight together may have the process killed "
                "rather than refused; %s (docs/reliability.md)", limit / mib, settings.workers, idle // mib,
                BUDGET_FACTOR, settings.max_inflight_bytes / mib, fix)


def _warn_of_the_gpu_memory(settings: Settings, gpu: int | None) -> None:
    """Workers past what the GPU (`gpu` bytes, NVML's) holds fail to start, or run out of its memory later
    (service.core.gpu)."""
    if gpu is None or settings.workers == 1 or settings.workers <= holds(gpu):
        return
    gib = 2**30
    log.warning("ATTEND_WORKERS=%d x (%.0f GiB a CUDA worker holds + a budget of %.0f GiB) is more than %.0f%% of "
                "the GPU's %.1f GiB: workers may fail to start or run out of its memory; ATTEND_WORKERS=auto runs %d",
                settings.workers, WORKER_BYTES / gib, MIN_BUDGET / gib, SHARE * 100, gpu / gib,
                auto_workers(usable_cores(), settings.device, gpu))


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        name = "ATTEND_" + "_".join(str(part) for part in first["loc"]).upper()
        return f"{name}: {first['msg']} (got {str(first.get('input'))[:100]!r})"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
