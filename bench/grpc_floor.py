"""The cost of gRPC alone, on the same pinning as bench/run.py: a grpc.aio server on uvloop (as the service
runs it, on uvicorn's loop) whose ModelInfer answers 200 bytes at once without reading what it was sent,
registered as unary (grpc reads the message first) and as a client stream of one message (as
service/grpc/guard.py registers every method), driven by bench/grpc_load.py with W1's pool. What it
prints is the floor below which no call through grpcio's asyncio server goes: the server's CPU per call,
beside the service's own gRPC and /attend JSON rows of `make bench` (bench/http_floor.py is the same for
HTTP).

The load generator is Python (grpcio's sync client, one process a connection, on the load core): the
table says how busy that core was, since at these rates the client is near its own bound.

    python bench/grpc_floor.py [--duration 4] [--concurrency 1,16] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402
import pools  # noqa: E402
from run import PIN, cpu_seconds  # noqa: E402

from tests.load.report import write_section  # noqa: E402
from tests.server import free_port  # noqa: E402

SERVER = """
import asyncio, sys
import grpc, uvloop
async def main():
    server = grpc.aio.server()
    async def unary(request, context):
        return b"x" * 200
    async def stream(requests, context):
        await context.read()
        return b"x" * 200
    handler = (grpc.unary_unary_rpc_method_handler(unary) if sys.argv[2] == "unary"
               else grpc.stream_unary_rpc_method_handler(stream))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": handler}),))
    server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
uvloop.run(main())
"""


def core_times(core: int) -> tuple[int, int]:
    """(all, idle) jiffies of one core so far."""
    fields = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith(f"cpu{core} "))
    values = [int(x) for x in fields.split()[1:]]
    return sum(values), values[3] + values[4]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--out", type=Path, help="a markdown file with a <!-- grpc-floor --> section")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="attend-grpc-floor-"))
    index = pools.write_pool(tmp, "W1grpc", [pools.grpc_raw(b) for b in pools.WORKLOADS["W1"].bodies()], http=False)
    table = ["| registered as | c | calls/s | p50 ms | p99 ms | server CPU us / call | load core busy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print("\n".join(table), flush=True)
    for mode in ("unary", "stream"):
        port = free_port()
        server = subprocess.Popen([*PIN, sys.executable, "-c", SERVER, str(port), mode], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            for c in (int(x) for x in args.concurrency.split(",")):
                loadgen.measure("grpc", port, index, c, 1)  # warm-up
                busy, cpu = core_times(loadgen.LOAD_CPU), cpu_seconds(server.pid)
                point = loadgen.measure("grpc", port, index, c, args.duration)
                after = core_times(loadgen.LOAD_CPU)
                per_call = 1e6 * (cpu_seconds(server.pid) - cpu) / max(point.requests, 1)
                load = 1 - (after[1] - busy[1]) / max(after[0] - busy[0], 1)
                table.append(f"| {'unary' if mode == 'unary' else 'client stream of one message'} | {c} | "
                             f"{point.rps:.0f} | {point.percentile(50):.2f} | {point.percentile(99):.2f} | "
                             f"{per_call:.0f} | {load:.0%} |")
                print(table[-1], flush=True)
        finally:
            server.kill()
            server.wait()
    if args.out:
        write_section(args.out, "grpc-floor", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
