"""Paired A/B of the service: two (or more) versions or settings up at once, each pinned to core 0
(idle while another is measured), wrk on core 1 alternating between them point by point. Single
runs of this shared machine move by 10-30%; a ratio of two points measured seconds apart moves by a
few percent, so the median of the per-round ratios is what to compare.

    python bench/ab.py /path/to/other/checkout . [--workloads W1,W3] [--concurrency 16,1] [--rounds 6]
    python bench/ab.py . ".+ATTEND_MAX_BATCH_WAIT_US=0"          (a setting against the default)

Workloads are bench/run.py's (W1, W2, W3), and W2bin: W2 through the Open Inference Protocol in
binary tensors (`POST /v2/models/dot_product/infer`).

Each SERVER is a checkout of this repository (`git worktree add /tmp/base <commit>`), optionally
followed by `+NAME=VALUE,...` service settings. Every server uses this checkout's virtual
environment and model repository. The first server is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import PIN, binary_request, service_env, workloads, wrk  # noqa: E402

from tests.server import running_service  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="+", metavar="SERVER")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--concurrency", default="16,1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0, help="per point")
    args = parser.parse_args()
    if len(args.servers) < 2:
        parser.error("two servers at least")
    wanted = args.workloads.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="attend-ab-"))
    # name -> (body file, path, binary header length)
    bodies: dict[str, tuple[Path, str, int | None]] = {}
    for name, (_, body) in workloads().items():
        if name in wanted:
            bodies[name] = (tmp / f"{name}.json", "/attend", None)
            bodies[name][0].write_bytes(json.dumps(body).encode())
        if name == "W2" and "W2bin" in wanted:
            binary, header_length = binary_request(body)
            bodies["W2bin"] = (tmp / "W2.bin", "/v2/models/dot_product/infer", header_length)
            bodies["W2bin"][0].write_bytes(binary)
    measured: dict[tuple[str, int, str], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        servers = []
        for spec in args.servers:
            tree, _, settings = spec.partition("+")
            extra = dict(s.split("=", 1) for s in settings.split(",") if s)
            command = ["bash", "-c", f"cd {Path(tree).resolve()} && exec {sys.executable} -m service"]
            url, proc = stack.enter_context(running_service(args.repository, prefix=PIN, command=command,
                                                             **service_env(True, extra)))
            servers.append((spec, int(url.rsplit(":", 1)[1]), proc))
        for name, (path, url_path, header_length) in bodies.items():
            for c in (int(c) for c in args.concurrency.split(",")):
                for _, port, _ in servers:
                    wrk(port, path, c, 1, None, url_path, header_length)  # warm-up
                for r in range(args.rounds):
                    for spec, port, proc in servers if r % 2 == 0 else servers[::-1]:
                        print(f"[{r + 1}/{args.rounds}] {name} c={c} {spec} ...", file=sys.stderr)
                        result = wrk(port, path, c, args.seconds, proc.pid, url_path, header_length)
                        if result["non_2xx"] or result["timeout"] or result["read"] or result["connect"]:
                            raise RuntimeError(f"{name} c={c} {spec}: errors {result}")
                        measured.setdefault((name, c, spec), []).append(result)
    print("| workload | concurrency | server | req/s | p50 ms | p99 ms | CPU us / request | x first (paired, median) | "
          "per round |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for (name, c, spec), runs in measured.items():
        base = measured[(name, c, args.servers[0])]
        ratios = [r["rps"] / b["rps"] for r, b in zip(runs, base, strict=True)]
        print(f"| {name} | {c} | {spec} | {statistics.median(r['rps'] for r in runs):.0f} | "
              f"{statistics.median(r['p50_us'] for r in runs) / 1e3:.2f} | "
              f"{statistics.median(r['p99_us'] for r in runs) / 1e3:.2f} | "
              f"{statistics.median(r['cpu_us'] for r in runs):.0f} | {statistics.median(ratios):.3f} | "
              + " ".join(f"{x:.2f}" for x in ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
