"""What decoding the bodies `make bench` sends costs, in process: for each workload, every body of its pool
(bench/pools.py) through `service.protocols.attend.decode_body` and into a `service.core.batching.Job`
(the sizes the batcher reads), in pool order, one core, one thread; a figure is a body's mean over one
pass of the pool, and the median of the passes. Plans and the layouts a model has seen carry over from
pass to pass, as they do from request to request in a server.

`--tree PATH` times another checkout the same way (`git worktree add /tmp/base <commit>`) on the same
bodies and repository: each tree runs in its own process, the two alternating round by round, and the
table gives each tree's median over the rounds and the median of the per-round ratios (paired: a busy
machine slows both sides of a round alike).

    python bench/decode.py [--tree PATH] [--workloads W1,W3,W4,W5,W6,W7] [--rounds 3] [--passes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = 0


def measure(workloads: list[str], passes: int, repository: Path) -> dict[str, float]:
    """Seconds a body of each workload's pool, in the checkout this process imports `service` from."""
    sys.path.insert(1, str(ROOT / "bench"))
    from pools import WORKLOADS

    from service.core.batching import Job
    from service.core.runtime import Registry
    from service.protocols.attend import decode_body

    os.sched_setaffinity(0, {CPU})
    registry = Registry.load(repository, "cpu", 1)
    seconds = {}
    for name in workloads:
        bodies = [json.dumps(b).encode() for b in WORKLOADS[name].bodies()]
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            for body in bodies:
                Job(decode_body(body, registry), 0.0)
            times.append((time.perf_counter() - start) / len(bodies))
        seconds[name] = statistics.median(times)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, help="another checkout, timed the same way (the ratio's base)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workloads", default="W1,W3,W4,W5,W6,W7")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=5, help="passes over a pool, a round")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the tree one round's process imports
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.child is not None:
        sys.path.insert(0, str(args.child))
        print(json.dumps(measure(workloads, args.passes, args.repository)))
        return 0
    trees = [args.tree.resolve(), ROOT] if args.tree else [ROOT]  # the other tree first: the ratio's base
    results: list[list[dict[str, float]]] = [[] for _ in trees]
    for r in range(args.rounds):
        for i in range(len(trees)) if r % 2 == 0 else reversed(range(len(trees))):
            out = subprocess.run([sys.executable, __file__, "--child", str(trees[i]), "--workloads", args.workloads,
                                  "--passes", str(args.passes), "--repository", str(args.repository.resolve())],
                                 capture_output=True, text=True, check=True).stdout
            results[i].append(json.loads(out.splitlines()[-1]))
    print(f"decode_body + Job a body, medians of {args.rounds} rounds of {args.passes} passes; one core\n")
    header = "| workload | " + " | ".join(f"{t} us" for t in trees)
    if args.tree:
        print(header + " | this / other (paired median) | per round |")
        print("| --- | ---: | ---: | ---: | --- |")
    else:
        print(header + " |\n| --- | ---: |")
    for name in workloads:
        cells = [f"{1e6 * statistics.median(r[name] for r in tree):.1f}" for tree in results]
        row = f"| {name} | " + " | ".join(cells)
        if args.tree:
            ratios = [b[name] / a[name] for a, b in zip(results[0], results[1], strict=True)]
            row += f" | {statistics.median(ratios):.2f} | {' '.join(f'{x:.2f}' for x in ratios)}"
        print(row + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
