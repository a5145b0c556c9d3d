"""Where a request's CPU goes, in the service and in the plain server, under `make bench`'s load: each
server pinned to core 0 (bench/run.py's `server`), wrk with a row's pool of varied bodies on core 1
(bench/loadgen.py), and py-spy sampling the server's event-loop thread meanwhile. A sample the thread
spends waiting (epoll with nothing to do) is not taken, so a stage's samples over the sampling rate are
its CPU time: divided by the requests answered, its microseconds a request. The stages:

- session run: ONNX Runtime's `InferenceSession.run` (batched requests share one);
- JSON parse: simdjson's (the service), orjson.loads (the plain server);
- arrays and checks: the rest of the decode: the body's structure, the arrays, their cast and every check
  (the service), np.asarray and the valid lengths (the plain server);
- JSON encode: orjson.dumps of the answer;
- batching: the queue, the batch's merge and the slicing of each request's answer out of it;
- socket write: the one `transport.write` of each response (the system call, TCP over loopback included);
- metrics and logs: prometheus_client's, the access log, request IDs;
- HTTP, ASGI, framework: uvicorn, httptools, the service's HTTP layer or FastAPI and Starlette;
- event loop: uvloop's own C code, the system calls it makes (reads, epoll) and its timers.

The sum is the event-loop thread's CPU a request; `CPU us / req` beside it is the whole process's (other
threads: the access log's writer, inference threads). Under each table, a ceiling: how many times the plain
server's throughput the service's could be on its one core were its session runs and its batching free
(the plain server's thread CPU a request over the service's less those two stages): a bar above it needs
the stages both servers pay, or the service's checks, HTTP layer and metrics, to cost less. py-spy
stops the process for each sample (its default, for whole stacks), at `--rate` a second, which slows both
servers somewhat: read the split, not the totals, against `make bench`. Needs py-spy (the dev extra) and
wrk.

    python bench/where.py [--rows W1,W3] [--concurrency 1,16] [--seconds 6] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import collections
import linecache
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import measure  # noqa: E402
from pools import make_pools  # noqa: E402
from run import cpu_seconds, server  # noqa: E402

from tests.load.report import write_section  # noqa: E402

STAGES = ("session run", "JSON parse", "arrays and checks", "JSON encode", "batching", "socket write",
          "metrics and logs", "HTTP, ASGI, framework", "event loop", "other")

# (stage, what a frame's function and file hold) in order: a sample goes to the first rule that one of
# its frames matches. The plain server's own lines are told apart by their source text (`_PLAIN_LINES`).
_RULES = (
    ("session run", "Session.run (", "onnxruntime"),
    ("JSON parse", "_document (", "service/protocols/json_arrays.py"),
    ("JSON parse", "_parse_slowly (", "service/protocols/json_arrays.py"),
    ("JSON encode", "attend_parts (", "service/protocols/attend.py"),
    ("arrays and checks", "decode_body (", "service/protocols/attend.py"),
    ("arrays and checks", "AttendCodec.decode (", "service/protocols/attend.py"),
    ("socket write", "CoalescingTransport.write (", "service/http/transport.py"),
    ("metrics and logs", "", "service/core/metrics.py"),
    ("metrics and logs", "", "service/core/logs.py"),
    ("metrics and logs", "", "prometheus_client/"),
    ("batching", "", "service/core/batching.py"),
    ("batching", "", "service/core/merge.py"),
    ("batching", "", "service/core/jobs.py"),
    ("batching", "", "service/core/runcost.py"),
)
_PLAIN_LINES = (("orjson.loads", "JSON parse"), ("orjson.dumps", "JSON encode"), ("np.asarray", "arrays and checks"),
                ("np.repeat", "arrays and checks"), ("transport.write", "socket write"))
_FRAMEWORK = ("uvicorn/", "httptools", "starlette/", "fastapi/", "service/http/", "service/core/dataplane.py",
              "service/core/exchange.py",
              "plain_server.py", "anyio/", "service/asgi.py")


def _where(frame: str) -> tuple[str, str, int]:
    """("Function (", file, line) of a py-spy raw frame `Function (path/file.py:12)`."""
    function, _, place = frame.rpartition(" (")
    path, _, line = place.rstrip(")").rpartition(":")
    return function + " (", path, int(line) if line.isdigit() else 0


def stage_of(stack: list[str]) -> str:
    """The stage of one sample of the event loop's thread (its frames, outermost first)."""
    frames = [_where(f) for f in stack]
    for stage, function, path in _RULES:
        if any(f.startswith(function) and path in p for f, p, _ in frames):
            return stage
    for _, path, line in reversed(frames):  # innermost first: the plain server's line, or uvicorn's write
        if path.endswith(("plain_server.py", "uvicorn/protocols/http/httptools_impl.py")):
            text = linecache.getline(path, line)
            for needle, stage in _PLAIN_LINES:
                if needle in text:
                    return stage
    # What runs under the event loop: the frames inside asyncio's Runner.run (the loop's run_until_complete,
    # in uvloop's C code, calls them back).
    inner = frames
    for i, (function, path, _) in enumerate(frames):
        if function.startswith("Runner.run (") and path.endswith("asyncio/runners.py"):
            inner = frames[i + 1:]
    if not inner:
        return "event loop"  # in uvloop's own C code
    if any(any(part in p for part in _FRAMEWORK) for _, p, _ in inner):
        return "HTTP, ASGI, framework"
    return "other"


def main_thread_samples(raw: str) -> collections.Counter:
    """Samples by stage of py-spy's raw output (`frame;frame;... count` a line), the event loop's thread
    only (uvicorn's Server.run under it)."""
    stages: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if count.isdigit() and any(f.startswith("Server.run (") for f in frames):
            stages[stage_of(frames)] += int(count)
    return stages


def profile(kind: str, repository: Path, index: Path, concurrency: int, seconds: float, rate: int, py_spy: str
            ) -> tuple[collections.Counter, int, float, float, float]:
    """(samples by stage, requests answered, CPU seconds of the process and of its event loop's thread,
    requests a second) of one server under one point's load."""
    with server(kind, repository, {}) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        measure("wrk", port, index, concurrency, 1)  # warm-up
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "raw.txt"
            spy = subprocess.Popen([py_spy, "record", "-f", "raw", "--full-filenames", "-r", str(rate),
                                    "-o", str(out), "--pid", str(proc.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attached
            cpu, loop_cpu = cpu_seconds(proc.pid), cpu_seconds(proc.pid, proc.pid)  # the main thread: the loop's
            point = measure("wrk", port, index, concurrency, seconds)
            cpu, loop_cpu = cpu_seconds(proc.pid) - cpu, cpu_seconds(proc.pid, proc.pid) - loop_cpu
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)
            return main_thread_samples(out.read_text()), point.requests, cpu, loop_cpu, point.rps


def ceiling(plain: tuple, service: tuple) -> float:
    """How many times the plain server's throughput the service's could be on one core, were its session
    runs and its batching free: the event loop threads' CPU a request, the plain server's over the
    service's less those stages' shares (`profile`'s results of each)."""
    def per_request(result: tuple, free: tuple[str, ...] = ()) -> float:
        samples, requests, _, thread, _ = result
        share = 1 - sum(samples[stage] for stage in free) / max(1, sum(samples.values()))
        return thread / requests * share
    return per_request(plain) / per_request(service, ("session run", "batching"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rows", default="W1,W3", help="bench/pools.py's rows (pools of varied bodies)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--seconds", type=float, default=6.0, help="a point's load, whole seconds")
    parser.add_argument("--rate", type=int, default=250, help="py-spy's samples a second")
    parser.add_argument("--py-spy", default=str(Path(sys.executable).parent / "py-spy"))
    parser.add_argument("--out", type=Path, help="a markdown file with a <!-- where --> section")
    args = parser.parse_args()
    rows = args.rows.split(",")
    lines: list[str] = []

    def say(*text: str) -> None:
        lines.extend(text)
        print("\n".join(text), flush=True)

    with tempfile.TemporaryDirectory() as folder:
        pools = make_pools(Path(folder), rows)
        say(f"py-spy at {args.rate} a second, {args.seconds:g} s a point; a stage's us a request: its share of the "
            "event loop thread's samples times the thread's CPU (/proc) a request", "")
        for row in rows:
            for concurrency in map(int, args.concurrency.split(",")):
                results = {kind: profile(kind, args.repository, pools[row]["index"], concurrency, args.seconds,
                                         args.rate, args.py_spy) for kind in ("plain", "on")}
                table = [f"**{row}, c={concurrency}**", "", "| stage | plain us / req | service us / req |",
                         "| --- | ---: | ---: |"]
                for stage in STAGES:  # the thread's CPU a request, in the shares of its samples
                    cells = [f"{1e6 * r[3] / r[1] * r[0][stage] / max(1, sum(r[0].values())):.1f}"
                             for r in results.values()]
                    table.append(f"| {stage} | {' | '.join(cells)} |")
                for name, column in (("event loop's thread, in all", 3), ("the process, in all", 2)):
                    cells = [f"{1e6 * r[column] / r[1]:.1f}" for r in results.values()]
                    table.append(f"| {name} | {' | '.join(cells)} |")
                samples = [str(sum(r[0].values())) for r in results.values()]
                table.append(f"| samples of the thread | {' | '.join(samples)} |")
                table.append(f"| req/s | {' | '.join(f'{r[4]:.0f}' for r in results.values())} |")
                say(*table, "", f"At most {ceiling(results['plain'], results['on']):.2f}x the plain server, were the "
                    "service's session runs and batching free (the plain server's thread CPU a request over the "
                    "service's less those stages).", "")
    if args.out:
        write_section(args.out, "where", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
