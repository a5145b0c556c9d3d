"""The gRPC load generator of `make bench`: what bench/pool.lua does for HTTP/1.1, for the Open Inference
Protocol over gRPC (`inference.GRPCInferenceService/ModelInfer`).

    grpc_point(port, index, connections, seconds, load_cpu) -> loadgen.Point

One process a connection (its own channel, so its own HTTP/2 connection), all pinned to the load core,
as wrk runs one thread a connection there. The pool is the same kind of file bench/pools.py writes for
wrk (NAME.index: the pool file's name, then "offset length" a request), holding serialized
`ModelInferRequest`s: each process sends them as bytes through a unary call with no serializer (no
protobuf work on the client), walking the pool from its own starting point, and times each call with
`time.perf_counter_ns` from the moment it is made to its response's arrival (every request timed, no
samples added). A call's status other than OK counts as failed, under its code's name; DEADLINE_EXCEEDED
(30 s) and UNAVAILABLE (the connection) count as socket errors, as wrk counts its timeouts and connect
errors. The processes start, connect and then wait for one line on stdin, so that the measured window
holds no interpreter start-up.

    python bench/grpc_load.py --worker PORT INDEX FIRST SECONDS OUT    (one connection; what grpc_point runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHOD = "/inference.GRPCInferenceService/ModelInfer"
MAX_MESSAGE = 256 << 20  # W2's answers with weights are ~1-2 MB


def read_pool(index: Path) -> list[bytes]:
    lines = index.read_text().split("\n")
    data = Path(lines[0]).read_bytes()
    return [data[int(o):int(o) + int(n)] for o, n in (line.split() for line in lines[1:] if line)]


def worker(port: int, index: Path, first: int, seconds: float, out: Path) -> int:
    import grpc

    bodies = read_pool(index)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
    call = channel.unary_unary(METHOD)  # no serializers: bytes in, bytes out
    grpc.channel_ready_future(channel).result(timeout=30)
    print("ready", flush=True)
    sys.stdin.readline()
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    i, started = first, time.perf_counter_ns()
    until = started + int(seconds * 1e9)
    while True:
        body = bodies[i % len(bodies)]
        i += 1
        sent = time.perf_counter_ns()
        if sent >= until:
            break
        try:
            call(body, timeout=30)
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                errors["timeout"] += 1
            elif code == grpc.StatusCode.UNAVAILABLE:
                errors["connect"] += 1
            else:
                statuses[code.name] = statuses.get(code.name, 0) + 1
            continue
        latencies.append((time.perf_counter_ns() - sent) / 1e3)
    ended = time.perf_counter_ns()
    channel.close()
    out.write_text(json.dumps({"latencies_us": latencies, "seconds": (ended - started) / 1e9,
                               "statuses": statuses, "errors": errors}))
    return 0


def grpc_point(port: int, index: Path, connections: int, seconds: float, load_cpu: int | None = None):
    import numpy as np
    from loadgen import Point  # bench/ is on sys.path wherever loadgen is imported

    pin = ["taskset", "-c", str(load_cpu)] if load_cpu is not None else []
    pool = len(read_pool(index))
    with tempfile.TemporaryDirectory(prefix="attend-grpc-load-") as tmp:
        outs = [Path(tmp) / f"{k}.json" for k in range(connections)]
        procs = [subprocess.Popen([*pin, sys.executable, __file__, "--worker", str(port), str(index),
                                   str(k * pool // connections), str(seconds), str(out)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=os.environ | {"PYTHONUNBUFFERED": "1"})
                 for k, out in enumerate(outs)]
        try:
            for proc in procs:
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a gRPC load process could not connect to 127.0.0.1:{port}")
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            for proc in procs:
                if proc.wait(timeout=seconds + 60):
                    raise RuntimeError(f"a gRPC load process failed ({proc.returncode})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        results = [json.loads(out.read_text()) for out in outs]
    latencies = np.array([x for r in results for x in r["latencies_us"]], dtype=np.float64)
    statuses: dict[str, int] = {}
    errors = {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    for r in results:
        for key, count in r["statuses"].items():
            statuses[key] = statuses.get(key, 0) + count
        for key, count in r["errors"].items():
            errors[key] += count
    return Point(len(latencies), max(r["seconds"] for r in results), latencies, sum(statuses.values()),
                 statuses, errors)


if __name__ == "__main__":
    if len(sys.argv) != 7 or sys.argv[1] != "--worker":
        sys.exit(__doc__)
    sys.exit(worker(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), Path(sys.argv[6])))
