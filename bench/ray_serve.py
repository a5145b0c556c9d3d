"""Benchmark: the service under `python -m service` against the same app on Ray Serve (service/serve.py),
with one and two replicas, through each of Serve's ingress modes. Needs the ray extra (`make install-ray`).

    python bench/ray_serve.py [--duration 5] [--repeat 3] [--modes proxy,haproxy,direct]   (make bench-ray)

Modes (each a fresh local Ray, started with the mode's environment; Serve reads these at import):
- proxy:   Serve's default, its Python proxy actor in front of the replicas
- haproxy: RAY_SERVE_ENABLE_HA_PROXY=1, HAProxy in front, the replicas' own HTTP servers behind it (new in 2.60)
- direct:  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (direct ingress and more), wrk sent straight to the one replica's
           own HTTP server (a port Serve allocates; the proxy still listens on Serve's port, and is what a
           client there gets). With more replicas a balancer of one's own must spread clients over their
           ports: HAProxy mode is that, so direct is measured with one replica only.

gRPC (W1grpc: bench/pools.py's varied W1 bodies as ModelInfer messages, bench/grpc_load.py one process a
connection): `python -m service`'s own gRPC server against Serve's gRPC proxy (proxy mode, with
service.serve.GRPC_SERVICER, as deploy/ray/cluster.yaml); HAProxy and direct ingress carry HTTP only.

bench/run.py's conventions: every server (`python -m service`, or the whole Ray cluster: GCS, raylet,
controller, proxy, replicas) pinned to core 0, one ONNX Runtime thread a replica, access log at info;
wrk pinned to core 1; the W1 and W3 workloads of bench/run.py. CPU us / request is the user + system
time of every process of the server (the Ray cluster's all) over the point; memory is their summed PSS.
Prints a markdown table (and writes it with --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpc_load import grpc_point  # noqa: E402
from bench.pools import make_pools  # noqa: E402
from bench.run import LOAD_CPU, PIN, SERVER_CPU, machine, service_env, workloads, wrk  # noqa: E402
from tests.server import free_port, running_service  # noqa: E402

MODES = {"proxy": {}, "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}, "direct": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}


def child(port: int, grpc_port: int, repository: Path) -> int:
    """A Ray cluster serving the app, in this process's environment (its gRPC proxy on `grpc_port`, 0: none);
    on stdin "N" deploys N replicas (and answers "ready N" when they serve), end of input stops everything."""
    import ray
    from ray import serve

    from service.serve import GRPC_SERVICER, Attend

    env = {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cpu", **service_env(True, {})}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        grpc = {"grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]}} if grpc_port else {}
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **grpc)
        for line in sys.stdin:
            replicas = int(line)
            start = time.monotonic()
            serve.run(Attend.options(num_replicas=replicas,
                                     ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": env}}).bind(),
                      name="attend", route_prefix="/")
            print(f"ready {replicas} {time.monotonic() - start:.1f}", flush=True)
        start = time.monotonic()
        serve.shutdown()
        print(f"serve.shutdown {time.monotonic() - start:.1f}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    return 0


class RayServer:
    """The child above, pinned like every measured server; its whole process tree is the server."""

    def __init__(self, mode: str, repository: Path, grpc: bool):
        self.port = free_port()
        self.grpc_port = free_port() if grpc else 0
        self.log = tempfile.TemporaryFile(mode="w+")
        env = os.environ | MODES[mode] | {"RAY_ADDRESS": ""}
        start = time.monotonic()
        self.proc = subprocess.Popen(
            [*PIN, sys.executable, __file__, "--child", str(self.port), str(self.grpc_port), "--repository",
             str(repository)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.started_s = time.monotonic() - start

    def deploy(self, replicas: int) -> float:
        self.proc.stdin.write(f"{replicas}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.log.seek(0)
            raise RuntimeError(f"Serve did not start: {self.log.read()[-3000:]}")
        return float(line.split()[2])

    def stop(self) -> float:
        start = time.monotonic()
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()
        return time.monotonic() - start


def replica_port(pid: int) -> int:
    """The HTTP port of the server's one replica under direct ingress: of the replica process's listening
    sockets (Ray's own RPC ports among them), the one where GET /health/live answers 200."""
    import httpx

    (replica,) = [p for p in tree(pid) if "ServeReplica" in " ".join(p.cmdline())]
    for conn in replica.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            try:
                if httpx.get(f"http://127.0.0.1:{conn.laddr.port}/health/live", timeout=1).status_code == 200:
                    return conn.laddr.port
            except httpx.HTTPError:
                pass
    raise RuntimeError("no replica port answers /health/live")


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def pss_mib(pid: int) -> tuple[float, float]:
    """Summed PSS of the server's processes, and of its Serve replicas alone."""
    total = replicas = 0.0
    for p in tree(pid):
        try:
            pss = p.memory_full_info().pss / 2**20
            total += pss
            if "ServeReplica" in " ".join(p.cmdline()):
                replicas += pss
        except psutil.NoSuchProcess:
            pass
    return total, replicas


def measure(port: int, pid: int, body: Path, concurrency: int, warmup: float, seconds: float) -> dict:
    wrk(port, body, concurrency, warmup)
    before = cpu_seconds(pid)
    result = wrk(port, body, concurrency, seconds)
    result["cpu_us"] = 1e6 * (cpu_seconds(pid) - before) / max(result["requests"], 1)
    result["errors"] = sum(result[k] for k in ("non_2xx", "connect", "read", "timeout"))
    return result


def measure_grpc(port: int, pid: int, index: Path, concurrency: int, warmup: float, seconds: float) -> dict:
    """measure's figures for gRPC ModelInfer calls (bench/grpc_load.py)."""
    grpc_point(port, index, concurrency, warmup, LOAD_CPU)
    before = cpu_seconds(pid)
    point = grpc_point(port, index, concurrency, seconds, LOAD_CPU)
    return {"rps": point.rps, "p50_us": 1e3 * point.percentile(50), "p99_us": 1e3 * point.percentile(99),
            "cpu_us": 1e6 * (cpu_seconds(pid) - before) / max(point.requests, 1),
            "errors": point.failed + sum(point.errors.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default="proxy,haproxy,direct")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--no-grpc", action="store_true", help="HTTP only (no W1grpc rows)")
    parser.add_argument("--out", type=Path, help="also write the section (machine, command, tables) to this file")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(*args.child, args.repository)
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2

    work = {k: v for k, v in workloads().items() if k in ("W1", "W3")}
    tmp = Path(tempfile.mkdtemp(prefix="attend-bench-ray-"))
    for name, (_, body) in work.items():
        (tmp / f"{name}.json").write_text(json.dumps(body))
    grpc_rows = {} if args.no_grpc else {row: pool["index"] for row, pool in make_pools(tmp, ["W1grpc"]).items()}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    replica_counts = [int(r) for r in args.replicas.split(",")]
    servers = [("service", 1)] + [(m, r) for m in args.modes.split(",")
                                   for r in (replica_counts if m != "direct" else [1])]
    measured: dict[tuple, list[dict]] = {}
    memory: dict[tuple, list[tuple[float, float]]] = {}
    timings: dict[str, list[str]] = {}

    def points(label: tuple, port: int, pid: int, grpc_port: int = 0) -> None:
        for name in work:
            for c in concurrency:
                print(f"  {name} c={c} {label} ...", file=sys.stderr)
                r = measure(port, pid, tmp / f"{name}.json", c, args.warmup, args.duration)
                measured.setdefault((name, c, *label), []).append(r)
        for name, index in grpc_rows.items() if grpc_port else ():
            for c in concurrency:
                print(f"  {name} c={c} {label} ...", file=sys.stderr)
                r = measure_grpc(grpc_port, pid, index, c, args.warmup, args.duration)
                measured.setdefault((name, c, *label), []).append(r)
        memory.setdefault(label, []).append(pss_mib(pid))
        # The pinning holds for every process of the server (Ray's are the driver's descendants).
        cores = {frozenset(p.cpu_affinity()) for p in tree(pid)}
        if cores != {frozenset({SERVER_CPU})}:
            raise RuntimeError(f"{label}: server processes on cores {cores}, not only {SERVER_CPU}")

    for rep in range(args.repeat):
        order = ["service", *args.modes.split(",")]
        for kind in order if rep % 2 == 0 else order[::-1]:
            print(f"[{rep + 1}/{args.repeat}] {kind}", file=sys.stderr)
            if kind == "service":
                grpc_port = free_port() if grpc_rows else 0
                with running_service(args.repository, prefix=PIN,
                                     **service_env(True, {"ATTEND_GRPC_PORT": str(grpc_port)})) as (url, proc):
                    points(("service", 1), int(url.rsplit(":", 1)[1]), proc.pid, grpc_port)
                continue
            server = RayServer(kind, args.repository, kind == "proxy" and bool(grpc_rows))
            try:
                for replicas in replica_counts if kind != "direct" else [1]:
                    took = server.deploy(replicas)
                    timings.setdefault(kind, []).append(f"serve.run {replicas}: {took:.1f} s")
                    port = replica_port(server.proc.pid) if kind == "direct" else server.port
                    points((kind, replicas), port, server.proc.pid, server.grpc_port)
            finally:
                timings.setdefault(kind, []).append(f"stop {server.stop():.1f} s")
    shutil.rmtree(tmp)

    rows = {k: {f: statistics.median(r[f] for r in runs) for f in ("rps", "p50_us", "p99_us", "cpu_us", "errors")}
            for k, runs in measured.items()}
    labels = {"service": "`python -m service`", "proxy": "Serve, proxy (default)",
              "haproxy": "Serve, HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1`)",
              "direct": "Serve, direct ingress: the replica's port (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`)"}
    lines = ["| workload | concurrency | server | replicas | req/s | p50 ms | p99 ms | CPU us / request | errors | "
             "x service |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in [*work, *grpc_rows]:
        for c in concurrency:
            base = rows[(name, c, "service", 1)]["rps"]
            for kind, replicas in servers:
                if (name, c, kind, replicas) not in rows:  # gRPC: the service and Serve's proxy only
                    continue
                r = rows[(name, c, kind, replicas)]
                lines.append(f"| {name} | {c} | {labels[kind]} | {replicas} | {r['rps']:.0f} | "
                             f"{r['p50_us'] / 1e3:.2f} | {r['p99_us'] / 1e3:.2f} | {r['cpu_us']:.0f} | "
                             f"{r['errors']:.0f} | {r['rps'] / base:.2f} |")
    mem = ["", "Memory at the end of each server's points (PSS, MiB, median of the runs):", "",
           "| server | replicas | every process | the replicas |", "| --- | ---: | ---: | ---: |"]
    for kind, replicas in servers:
        total = statistics.median(m[0] for m in memory[(kind, replicas)])
        reps = statistics.median(m[1] for m in memory[(kind, replicas)])
        mem.append(f"| {labels[kind]} | {replicas} | {total:.0f} | {reps:.0f} |" if kind != "service"
                   else f"| {labels[kind]} | 1 | {total:.0f} | - |")
    legend = [f"- {name}: {text}" for name, (text, _) in work.items()] + [
        f"- {name}: gRPC ModelInfer, W1's varied bodies (bench/pools.py; raw_input_contents), through Serve's gRPC "
        "proxy" for name in grpc_rows]
    table = "\n".join(lines + mem)
    print(table)
    print("\n" + "\n".join(legend))
    print("\n" + "\n".join(f"- {k}: {', '.join(v)}" for k, v in timings.items()))
    if args.out:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = " ".join(["python bench/ray_serve.py", *sys.argv[1:]])
        args.out.write_text(
            f"Run {stamp} on: {machine()}; ray 2.60.0.\n\nCommand: `{command}`; every server pinned to core 0 (for "
            f"Ray: the whole cluster), one ORT thread a replica, access log at info; wrk (1 thread) on core 1; "
            f"{args.warmup:g} s warm-up then {args.duration:g} s per point; the median of {args.repeat} runs, the "
            f"servers in alternating order. CPU us / request: user + system time of every process of the server.\n\n"
            + "\n".join(legend) + "\n\n" + table + "\n\n"
            + "\n".join(f"- {k}: {', '.join(v)}" for k, v in timings.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
