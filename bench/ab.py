"""Paired A/B of the service: two (or more) versions or settings up at once, each pinned to core 0
(idle while another is measured), wrk on core 1 alternating between them point by point. Single
runs of this shared machine move by 10-30%; a ratio of two points measured seconds apart moves by a
few percent, so the median of the per-round ratios is what to compare. Beside requests/s, the server's
CPU time a request (what a request costs), paired the same way.

    python bench/ab.py /path/to/other/checkout . [--workloads W1,W3] [--concurrency 16,1] [--rounds 6]
    python bench/ab.py . ".+ATTEND_MAX_BATCH_WAIT_US=0"          (a setting against the default)

Workloads are bench/run.py's rows (bench/pools.py): W1-W7 pools of varied bodies (a different body a
request, made once and sent to every server), W2bin W2's pool through the Open Inference Protocol in
binary tensors, W1grpc and W2grpc over gRPC, W1r-W3r one body replayed (what this script measured before
2026-11-25). The load generators are bench/loadgen.py's (wrk with bench/pool.lua, bench/grpc_load.py):
every request timed, p50 and p99 from them.

Each SERVER is a checkout of this repository (`git worktree add /tmp/base <commit>`), optionally
followed by `+NAME=VALUE,...` service settings. Every server uses this checkout's virtual
environment and model repository. The first server is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import measure  # noqa: E402
from pools import ROWS, SEED, TRANSPORTS, make_pools  # noqa: E402
from run import PIN, cpu_seconds, service_env  # noqa: E402

from tests.server import free_port, running_service  # noqa: E402


def checkout(spec: str) -> tuple[list[str], dict[str, str]]:
    """SERVER (a checkout, optionally `+NAME=VALUE,...` settings): the command that runs `python -m service`
    in that checkout, and the settings."""
    tree, _, settings = spec.partition("+")
    extra = dict(s.split("=", 1) for s in settings.split(",") if s)
    return ["bash", "-c", f"cd {Path(tree).resolve()} && exec {sys.executable} -m service"], extra


def serve(repository: Path, spec: str, grpc_port: int = 0, **env: str):
    """SERVER as this script serves it: its checkout's service (`checkout`), pinned to the server core, at
    the measured settings, gRPC on `grpc_port` (0: off). A context manager of (url, process)."""
    command, extra = checkout(spec)
    return running_service(repository, prefix=PIN, command=command, **env,
                           **service_env(True, {"ATTEND_GRPC_PORT": str(grpc_port)} | extra))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="+", metavar="SERVER")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workloads", default="W1,W3", help=f"rows: {', '.join(ROWS)}")
    parser.add_argument("--concurrency", default="16,1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0, help="per point (whole seconds)")
    parser.add_argument("--seed", type=int, default=SEED, help="the pools' seed")
    args = parser.parse_args()
    if len(args.servers) < 2:
        parser.error("two servers at least")
    wanted = args.workloads.split(",")
    unknown = [w for w in wanted if w not in ROWS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(ROWS)}")
    tmp = Path(tempfile.mkdtemp(prefix="attend-ab-"))
    pools = make_pools(tmp, wanted, args.seed)
    measured: dict[tuple[str, int, str], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp)
        servers = []
        for spec in args.servers:
            grpc_port = free_port()
            url, proc = stack.enter_context(serve(args.repository, spec, grpc_port))
            servers.append((spec, {"wrk": int(url.rsplit(":", 1)[1]), "grpc": grpc_port}, proc))
        for name in wanted:
            client, index = TRANSPORTS[ROWS[name][1]].client, pools[name]["index"]
            for c in (int(c) for c in args.concurrency.split(",")):
                for _, ports, _ in servers:
                    measure(client, ports[client], index, c, 1)  # warm-up
                for r in range(args.rounds):
                    for spec, ports, proc in servers if r % 2 == 0 else servers[::-1]:
                        print(f"[{r + 1}/{args.rounds}] {name} c={c} {spec} ...", file=sys.stderr)
                        cpu_before = cpu_seconds(proc.pid)
                        point = measure(client, ports[client], index, c, args.seconds)
                        if not point.ok:
                            raise RuntimeError(f"{name} c={c} {spec}: {point.failed} failed {point.statuses}, "
                                               f"errors {point.errors}")
                        measured.setdefault((name, c, spec), []).append({
                            "rps": point.rps, "p50_ms": point.percentile(50), "p99_ms": point.percentile(99),
                            "cpu_us": 1e6 * (cpu_seconds(proc.pid) - cpu_before) / point.requests})
    print("| workload | concurrency | server | req/s | p50 ms | p99 ms | CPU us / request | x first (paired, median) | "
          "per round | CPU x first (paired, median) | per round |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for (name, c, spec), runs in measured.items():
        base = measured[(name, c, args.servers[0])]
        ratios = [r["rps"] / b["rps"] for r, b in zip(runs, base, strict=True)]
        cpu = [r["cpu_us"] / b["cpu_us"] for r, b in zip(runs, base, strict=True)]
        print(f"| {name} | {c} | {spec} | {statistics.median(r['rps'] for r in runs):.0f} | "
              f"{statistics.median(r['p50_ms'] for r in runs):.2f} | "
              f"{statistics.median(r['p99_ms'] for r in runs):.2f} | "
              f"{statistics.median(r['cpu_us'] for r in runs):.0f} | {statistics.median(ratios):.3f} | "
              + " ".join(f"{x:.2f}" for x in ratios) + f" | {statistics.median(cpu):.3f} | "
              + " ".join(f"{x:.2f}" for x in cpu) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
