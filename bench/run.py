"""Benchmark: the service over HTTP (wrk, a separate process on another core), batching on and off,
against the plain server a user could write instead (bench/plain_server.py) and against the same
work done in-process (JSON decode + session run + JSON encode, no HTTP).

    python bench/run.py [--duration 10] [--repeat 3] [--out docs/benchmarks.md]      (make bench)

Prints a markdown table: requests/s, p50 and p99 latency, the server's CPU time per request, and
each row's throughput as a multiple of the plain server's and of the in-process limit. Every server
is pinned to core 0 with one ONNX Runtime thread, wrk to core 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.core.runtime import Registry  # noqa: E402
from service.http.schemas import toy_request  # noqa: E402
from service.protocols.attend import attend  # noqa: E402
from tests.server import running_service  # noqa: E402

SERVER_CPU, LOAD_CPU = 0, 1
PIN = ("taskset", "-c", str(SERVER_CPU))
LABELS = {"plain": "plain", "on": "service", "off": "service, batching off"}


def workloads() -> dict[str, tuple[str, dict]]:
    rng = np.random.default_rng(0)
    X = np.ones((2, 4, 100))
    w2 = {
        "model": "dot_product",
        "queries": rng.normal(size=(8, 128, 64)).astype(np.float32).tolist(),
        "keys": rng.normal(size=(8, 128, 64)).astype(np.float32).tolist(),
        "values": rng.normal(size=(8, 128, 64)).astype(np.float32).tolist(),
        "valid_lens": rng.integers(1, 129, size=8).tolist(),
    }
    return {
        "W1": ("additive, the book's toy request (2 x 1 x 20 queries, 2 x 10 keys)", toy_request()),
        "W2": ("dot_product, 8 x 128 queries x 128 keys x 64 features, random 1-D valid lengths", w2),
        "W3": ("multi_head, the book's example (2 x 4 x 100, valid lengths [3, 2])",
               {"model": "multi_head", "queries": (X[:, :4]).tolist(), "keys": np.ones((2, 6, 100)).tolist(),
                "values": np.ones((2, 6, 100)).tolist(), "valid_lens": [3, 2]}),
    }


def in_process(repository: Path, bodies: dict[str, bytes], seconds: float) -> dict[str, dict]:
    """Decode + run + encode in this process, one core, one ORT thread: the limit."""
    os.sched_setaffinity(0, {SERVER_CPU})
    registry = Registry.load(repository, "cpu", 1)
    results = {}
    for name, body in bodies.items():
        for _ in range(20):
            attend(body, registry)
        latencies = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            attend(body, registry)
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        results[name] = {"rps": len(latencies) / sum(latencies), "p50_ms": 1e3 * statistics.median(latencies),
                         "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))]}
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return results


def service_env(batching: bool, extra: dict[str, str]) -> dict[str, str]:
    """The settings every measured service runs with: one ORT thread on its one core, and its default
    log level (so the access log is written, as in production)."""
    return {"ATTEND_INTRA_OP_THREADS": "1", "ATTEND_BATCHING": str(batching).lower(), "ATTEND_LOG_LEVEL": "info",
            **extra}


PLAIN = (sys.executable, "-m", "uvicorn", "bench.plain_server:app", "--port", "{port}", "--log-level", "warning")


def server(kind: str, repository: Path, extra: dict[str, str]):
    """A server to measure, started the same way for each kind: pinned to the server core, a fresh
    process. `kind` is "plain" (bench/plain_server.py), "on" or "off" (the service, batching on/off)."""
    if kind == "plain":
        return running_service(repository, prefix=PIN, command=PLAIN, ready_path="/docs",
                               PLAIN_REPOSITORY=str(repository))
    return running_service(repository, prefix=PIN, **service_env(kind == "on", extra))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def binary_request(body: dict) -> tuple[bytes, int]:
    """An /attend body as an Open Inference Protocol binary request: (body, JSON header length)."""
    entries, blobs = [], []
    for name in ("queries", "keys", "values", "valid_lens"):
        array = np.array(body[name], dtype=np.int64 if name == "valid_lens" else np.float32)
        entries.append({"name": name, "datatype": "INT64" if name == "valid_lens" else "FP32",
                        "shape": list(array.shape), "parameters": {"binary_data_size": array.nbytes}})
        blobs.append(array.tobytes())
    head = json.dumps({"inputs": entries, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(blobs), len(head)


def wrk(port: int, body_file: Path, connections: int, seconds: float, pid: int | None = None,
        path: str = "/attend", header_length: int | None = None) -> dict:
    cmd = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--timeout", "10s", "-s", str(ROOT / "bench" / "post.lua"), f"http://127.0.0.1:{port}{path}"]
    cpu_before = cpu_seconds(pid) if pid else 0.0
    env = os.environ | {"BODY": str(body_file)} | ({"HEADER_LENGTH": str(header_length)} if header_length else {})
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    result = json.loads(line)
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    if pid:
        result["cpu_us"] = 1e6 * (cpu_seconds(pid) - cpu_before) / max(result["requests"], 1)
    return result


def machine() -> str:
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    wrk_version = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("[")[0].strip()
    return (f"{cpu}, {os.cpu_count()} cores; Linux {platform.release()}; Python {platform.python_version()}, "
            f"onnxruntime {onnxruntime.__version__} (CPU execution provider), numpy {np.__version__}; {wrk_version}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measured point")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each point")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every point this many times, batching on and off alternating; report medians")
    parser.add_argument("--set", action="append", default=[], metavar="ATTEND_X=V",
                        help="a service setting for every run (repeatable)")
    parser.add_argument("--out", type=Path, help="also write the table (with the machine) to this markdown file")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("warning: one core; server and load generator share it", file=sys.stderr)

    work = {k: v for k, v in workloads().items() if k in args.workloads.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="attend-bench-"))
    bodies = {}
    for name, (_, body) in work.items():
        bodies[name] = json.dumps(body).encode()
        (tmp / f"{name}.json").write_bytes(bodies[name])
    if "W2" in work:  # the same request through the Open Inference Protocol's binary tensors
        binary, header_length = binary_request(work["W2"][1])
        (tmp / "W2.bin").write_bytes(binary)
    print(f"in-process limit ({args.duration:.0f} s per workload) ...", file=sys.stderr)
    limit = in_process(args.repository, bodies, args.duration)

    concurrency = [int(c) for c in args.concurrency.split(",")]
    kinds = ["plain", "on", "off"]
    measured: dict[tuple[str, int, str], list[dict]] = {}
    extra = dict(s.split("=", 1) for s in args.set)
    for rep in range(args.repeat):
        for name in work:
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:  # alternating, so that drift hits every kind
                # A fresh process per workload: one workload's allocations do not colour the next.
                with server(kind, args.repository, extra) as (url, proc):
                    port = int(url.rsplit(":", 1)[1])
                    for c in concurrency:
                        print(f"[{rep + 1}/{args.repeat}] {name} c={c} {LABELS[kind]} ...", file=sys.stderr)
                        wrk(port, tmp / f"{name}.json", c, args.warmup)
                        r = wrk(port, tmp / f"{name}.json", c, args.duration, proc.pid)
                        if r["non_2xx"] or r["timeout"] or r["read"] or r["connect"]:
                            raise RuntimeError(f"{name} c={c} {kind}: errors {r}")
                        measured.setdefault((name, c, kind), []).append(r)
                        if name == "W2" and kind == "on":
                            infer = "/v2/models/dot_product/infer"
                            wrk(port, tmp / "W2.bin", c, args.warmup, None, infer, header_length)
                            r = wrk(port, tmp / "W2.bin", c, args.duration, proc.pid, infer, header_length)
                            if r["non_2xx"] or r["timeout"] or r["read"] or r["connect"]:
                                raise RuntimeError(f"W2 binary c={c}: errors {r}")
                            measured.setdefault(("W2 binary", c, kind), []).append(r)
    rows = {key: {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_us", "p99_us", "cpu_us")}
            for key, runs in measured.items()}
    shutil.rmtree(tmp)

    lines = ["| workload | concurrency | server | req/s | p50 ms | p99 ms | CPU us / request | x plain | "
             "x in-process |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in work:
        for c in concurrency:
            plain = rows[(name, c, "plain")]["rps"]
            for kind in kinds:
                r = rows[(name, c, kind)]
                lines.append(f"| {name} | {c} | {LABELS[kind]} | {r['rps']:.0f} | {r['p50_us'] / 1e3:.2f} | "
                             f"{r['p99_us'] / 1e3:.2f} | {r['cpu_us']:.0f} | {r['rps'] / plain:.2f} | "
                             f"{r['rps'] / limit[name]['rps']:.2f} |")
    summary = ["", "The service (batching on) as a multiple of the plain server's throughput:", "",
               "| workload | " + " | ".join(f"c={c}" for c in concurrency) + " |",
               "| --- |" + " ---: |" * len(concurrency)]
    for name in work:
        summary.append(f"| {name} | " + " | ".join(
            f"{rows[(name, c, 'on')]['rps'] / rows[(name, c, 'plain')]['rps']:.2f}x" for c in concurrency) + " |")
    legend = [f"- {name}: {text}" for name, (text, _) in work.items()]
    legend += ["- plain: bench/plain_server.py, the ~40-line FastAPI server a user could write instead (orjson, "
               "NumPy, the same ONNX models, no checks, no batching)",
               "- service: `python -m service` at its defaults (access log on), batching on or off"]
    if "W2" in work:
        summary += ["", "W2 through the Open Inference Protocol with binary tensors "
                    "(`POST /v2/models/dot_product/infer`, 786 KB in and out), against the same request as JSON "
                    "through `/attend` (4 MB in, 1.8 MB out), the same service process:", "",
                    "| concurrency | binary req/s | p50 ms | CPU us / request | JSON req/s | binary / JSON |",
                    "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in concurrency:
            b, j = rows[("W2 binary", c, "on")], rows[("W2", c, "on")]
            summary.append(f"| {c} | {b['rps']:.0f} | {b['p50_us'] / 1e3:.2f} | {b['cpu_us']:.0f} | {j['rps']:.0f} | "
                           f"{b['rps'] / j['rps']:.1f}x |")
    inproc = ["", "In-process limit (decode + session run + encode, one core, one ORT thread):", "",
              "| workload | req/s | p50 ms | p99 ms |", "| --- | ---: | ---: | ---: |"]
    inproc += [f"| {n} | {v['rps']:.0f} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} |" for n, v in limit.items()]
    table = "\n".join(lines + summary + inproc)
    print(table)
    print("\n" + "\n".join(legend))
    if args.out:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = " ".join(["python bench/run.py", f"--duration {args.duration:g}", f"--repeat {args.repeat}",
                            *(f"--set {s}" for s in args.set)])
        text = (f"Run {stamp} on: {machine()}.\n\nCommand: `{command}`; "
                f"server pinned to core {SERVER_CPU} (one ORT intra-op thread), wrk (1 thread) to core {LOAD_CPU}; "
                f"{args.warmup:g} s warm-up then {args.duration:g} s per point; the median of {args.repeat} "
                f"measurements of each point, the servers in alternating order, a fresh process for each. "
                f"CPU us / request: the server process's user + system time over the point, per request.\n\n"
                + "\n".join(legend) + "\n\n" + table + "\n")
        # The sections other commands wrote (from the first `## ` heading on) stay.
        previous = args.out.read_text() if args.out.exists() else ""
        kept = previous[previous.index("\n## "):] if "\n## " in previous else ""
        args.out.write_text(text + kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
