"""What the gRPC server costs HTTP when it only listens: `python -m service` with ATTEND_GRPC_PORT=0 and with a
port, both up, each pinned to the server core as bench/run.py pins it, wrk with bench/pool.lua on the load
core; W1 and W3's pools at c=1 and c=16, the two servers alternating point by point over rounds (the order
swapped every other round). Prints the throughput ratio (listening / off) of each round and the medians.

    python bench/grpc_listening.py [--rounds 3] [--duration 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402
import pools  # noqa: E402
from run import PIN, service_env  # noqa: E402

from tests.load.report import write_section  # noqa: E402
from tests.server import free_port, running_service  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="a markdown file with a <!-- grpc-listening --> section")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="attend-grpc-listening-"))
    rows = ("W1", "W3")
    index = {row: pools.make_pools(tmp, [row])[row]["index"] for row in rows}
    table = ["| row | c | req/s, gRPC off | req/s, gRPC listening | listening / off | per round |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(table), flush=True)
    with contextlib.ExitStack() as stack:
        ports = {}
        for name, grpc_port in (("off", 0), ("listening", free_port())):
            url, _ = stack.enter_context(running_service(
                args.repository, prefix=PIN, **service_env(True, {"ATTEND_GRPC_PORT": str(grpc_port)})))
            ports[name] = int(url.rsplit(":", 1)[1])
        for row in rows:
            for c in (1, 16):
                rps: dict[str, list[float]] = {"off": [], "listening": []}
                for name in ports:
                    loadgen.measure("wrk", ports[name], index[row], c, 1)  # warm-up
                for rnd in range(args.rounds):
                    for name in (("off", "listening") if rnd % 2 == 0 else ("listening", "off")):
                        rps[name].append(loadgen.measure("wrk", ports[name], index[row], c, args.duration).rps)
                ratios = [a / b for a, b in zip(rps["listening"], rps["off"], strict=True)]
                table.append(f"| {row} | {c} | {statistics.median(rps['off']):.0f} | "
                             f"{statistics.median(rps['listening']):.0f} | {statistics.median(ratios):.2f} | "
                             + " ".join(f"{r:.2f}" for r in ratios) + " |")
                print(table[-1], flush=True)
    if args.out:
        write_section(args.out, "grpc-listening", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
