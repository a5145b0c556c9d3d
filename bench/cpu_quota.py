"""The service in a cgroup with a CPU quota (a container's `--cpus`, a pod's CPU limit): its default threads, per tree.

    python bench/cpu_quota.py [--trees . ../before] [--quota 0.5] [--rounds 3] [--seconds 10] [--out FILE]

Each tree's `python -m service` runs at its defaults in a cgroup of its own with --quota CPUs' worth of time a
period (cgroup v2's cpu.max, or v1's cpu.cfs_quota_us); wrk (bench/post.lua, 4 connections, one thread, outside the
cgroup) posts a W2-like body to /attend: dot_product 8 x 128 x 128 x 64, lengths 100, no weights. The trees
alternate round by round; the table has the medians of the rounds. Needs root (the cgroup) and wrk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.load.report import write_section  # noqa: E402
from tests.server import free_port, limited_cgroup  # noqa: E402

SECTION = "cpu_quota"


@contextlib.contextmanager
def quota_cgroup(cpus: float) -> Iterator[Path]:
    """A new cgroup allowed `cpus` CPUs' worth of time each 100 ms period, removed afterwards."""
    limit = round(cpus * 100_000)
    folder = limited_cgroup(("cpu.max", f"{limit} 100000"), ("cpu", "cpu.cfs_quota_us", str(limit)))
    if folder is None:
        raise SystemExit("no writable cgroup filesystem (root, /sys/fs/cgroup or /sys/fs/cgroup/cpu)")
    try:
        yield Path(folder)
    finally:
        for _ in range(50):  # its processes are gone a moment after they exit
            with contextlib.suppress(OSError):
                os.rmdir(folder)
                break
            time.sleep(0.1)


def body(path: Path) -> None:
    rng = np.random.default_rng(0)
    queries, keys = (rng.standard_normal((8, 128, 64)).round(3).tolist() for _ in range(2))
    path.write_text(json.dumps({"model": "dot_product", "queries": queries, "keys": keys, "values": keys,
                                "valid_lens": [100] * 8, "return_weights": False}))


def one_round(tree: Path, cgroup: Path, repository: Path, request: Path, seconds: int) -> dict[str, float]:
    port = free_port()
    env = os.environ | {"ATTEND_PORT": str(port), "ATTEND_GRPC_PORT": "0", "ATTEND_LOG_LEVEL": "warning",
                        "ATTEND_MODEL_REPOSITORY": str(repository)}
    service = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "service",
                                sys.executable, "-m", "service"], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise SystemExit(f"the service of {tree} did not become ready")
        run = subprocess.run(["wrk", "-t1", "-c4", f"-d{seconds}s", "-s", str(ROOT / "bench" / "post.lua"),
                              f"http://127.0.0.1:{port}/attend"], env=os.environ | {"BODY": str(request)},
                             capture_output=True, text=True, check=True)
        point = json.loads(run.stdout.strip().splitlines()[-1])
        if point["non_2xx"] or point["timeout"]:
            raise SystemExit(f"errors from {tree}: {point}")
        return {"rps": point["requests"] / point["duration_us"] * 1e6, "p50": point["p50_us"] / 1000,
                "p99": point["p99_us"] / 1000}
    finally:
        service.terminate()
        service.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[ROOT])
    parser.add_argument("--quota", type=float, default=0.5, help="CPUs' worth of time a period")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--out", type=Path, help=f"markdown file to write the table into (section {SECTION})")
    args = parser.parse_args()
    results: dict[Path, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    with tempfile.TemporaryDirectory() as scratch, quota_cgroup(args.quota) as cgroup:
        request = Path(scratch) / "w2.json"
        body(request)
        for _ in range(args.rounds):
            for tree in args.trees:
                results[tree].append(one_round(tree.resolve(), cgroup, args.repository.resolve(), request,
                                               args.seconds))
                print(tree, results[tree][-1], flush=True)
    table = ["| tree | requests/s | p50 ms | p99 ms |", "| --- | ---: | ---: | ---: |"]
    for tree, points in results.items():
        median = {key: statistics.median(p[key] for p in points) for key in ("rps", "p50", "p99")}
        table.append(f"| {tree} | {median['rps']:.1f} | {median['p50']:.0f} | {median['p99']:.0f} |")
    table += ["", f"Quota {args.quota:g} CPU of the {len(os.sched_getaffinity(0))} cores; medians of {args.rounds} "
              f"rounds of {args.seconds} s, the trees alternating; 4 connections."]
    print("\n".join(table))
    if args.out:
        write_section(args.out, SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
