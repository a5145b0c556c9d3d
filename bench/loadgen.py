"""The load generator of `make bench` and bench/ab.py: a pool of bodies, a different one a request, each
request timed.

    measure("wrk", port, index, connections, seconds) -> Point

"wrk" is wrk 4 (Debian's package, LuaJIT) with bench/pool.lua: one thread a connection, pinned to the
load core, a body of the pool a request (mapped once, shared by the threads), every request's time
from clock_gettime (no samples added for coordinated omission, which wrk's own histogram adds).
"grpc" is bench/grpc_load.py: one process a connection on the load core, the pool's serialized
ModelInferRequests sent as bytes, every call timed the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LOAD_CPU = 1


@dataclass
class Point:
    requests: int  # responses received, each timed
    seconds: float
    latencies_us: np.ndarray
    failed: int  # non-200 responses
    statuses: dict  # their statuses: status -> count
    errors: dict  # socket errors (connect, read, write, timeout)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        """Milliseconds, from every request's time."""
        return float(np.percentile(self.latencies_us, q)) / 1e3 if len(self.latencies_us) else float("nan")

    @property
    def ok(self) -> bool:
        """No error answer and no socket error (a point too short for any answer is not an error: its
        requests/s is 0 and it has no percentiles)."""
        return not self.failed and not any(self.errors.values())


def wrk(port: int, index: Path, connections: int, seconds: float, load_cpu: int | None = LOAD_CPU) -> Point:
    pin = ["taskset", "-c", str(load_cpu)] if load_cpu is not None else []
    with tempfile.NamedTemporaryFile(prefix="attend-latencies-", suffix=".txt") as out:
        cmd = [*pin, "wrk", f"-t{connections}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout",
               "30s", "-s", str(ROOT / "bench" / "pool.lua"), f"http://127.0.0.1:{port}"]
        env = os.environ | {"POOL": str(index), "LATENCIES": out.name, "THREADS": str(connections)}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
        if run.returncode or not lines:
            raise RuntimeError(f"wrk failed ({run.returncode}): {run.stdout[-2000:]} {run.stderr[-2000:]}")
        summary = json.loads(lines[-1])
        latencies = np.loadtxt(out.name, dtype=np.float64, ndmin=1)
    return Point(len(latencies), summary["duration_us"] / 1e6, latencies, summary["failed"], summary["statuses"],
                 {k: summary[k] for k in ("connect", "read", "write", "timeout")})


def grpc(port: int, index: Path, connections: int, seconds: float, load_cpu: int | None = LOAD_CPU) -> Point:
    from grpc_load import grpc_point

    return grpc_point(port, index, connections, seconds, load_cpu)


CLIENTS = {"wrk": wrk, "grpc": grpc}


def measure(client: str, port: int, index: Path, connections: int, seconds: float,
            load_cpu: int | None = LOAD_CPU) -> Point:
    return CLIENTS[client](port, index, connections, seconds, load_cpu)
