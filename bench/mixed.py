"""What a batch of varied bodies costs: for each workload, groups of C requests from its pool
(bench/pools.py, the bodies `make bench` sends) queued together in their model's batcher, in process
(no HTTP, decoded beforehand), then let go; against the same requests run one by one.

    python bench/mixed.py [--tree PATH] [--workloads W1,W3,W4,W5] [--concurrency 16] [--groups 24]

Per workload it prints: the layouts (distinct shapes) among a group's requests, the session runs the
batcher made of them, the time from letting the group go to its last answer a request (merge, runs,
slicing and encoding; a run on an inference thread included), the same for each request run alone
(`run_batch` of one job: what a server without batching does a request), and the padding (the share
of the merged inputs' elements that are zeros added to make a batch; outputs pad as the inputs do).
`--tree` measures another checkout's service (e.g. `git worktree add /tmp/base main`) with this
checkout's pools: the same bodies before and after a change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose service is measured")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workloads", default="W1,W3,W4,W5")
    parser.add_argument("--concurrency", type=int, default=16, help="requests a group")
    parser.add_argument("--groups", type=int, default=24, help="groups measured a workload (after 4 of warm-up)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    sys.path.insert(1, str(ROOT / "bench"))
    from pools import WORKLOADS

    from service.core import batching
    from service.core.batching import BatchLimits, Job, Scheduler, run_batch
    from service.core.metrics import Metrics
    from service.core.runtime import Registry
    from service.protocols.attend import decode_body, encode_attend

    padding: list[tuple[int, int]] = []  # (elements merged, elements the requests sent), a merged run
    merge = batching.merge

    def counted(model, jobs, *rest, **kw):
        feed = merge(model, jobs, *rest, **kw)
        if len(jobs) > 1:
            padding.append((sum(a.size for a in feed.values()),
                            sum(a.size for j in jobs for a in j.request.feed.values())))
        return feed

    batching.merge = counted
    registry = Registry.load(args.repository, "cpu", 1)
    c = args.concurrency
    print(f"service from {args.tree.resolve()}; {c} requests a group, {args.groups} groups a workload\n")
    print("| workload | layouts a group | runs a group | us a request, batched | us a request, alone | "
          "alone / batched | padding |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        bodies = [json.dumps(b).encode() for b in workload.bodies()]
        total = (4 + args.groups) * c
        bodies = (bodies * (total // len(bodies) + 1))[:total]
        requests = [decode_body(b, registry) for b in bodies]
        model = requests[0].model
        alone, metrics = [], Metrics()
        for i, request in enumerate(requests):
            start = time.perf_counter()
            run_batch(model, [Job(request, float("inf"), encode_attend)], metrics)
            if i >= 4 * c:
                alone.append(time.perf_counter() - start)
        padding.clear()
        batched, runs, layouts = asyncio.run(_groups(requests, c, Scheduler, BatchLimits, Job, Metrics, registry,
                                                     encode_attend))
        merged = sum(m for m, _ in padding) or 1
        sent = sum(s for _, s in padding)
        print(f"| {name} | {statistics.mean(layouts):.1f} | {statistics.mean(runs):.1f} | "
              f"{1e6 * statistics.median(batched) / c:.0f} | {1e6 * statistics.mean(alone):.0f} | "
              f"{statistics.mean(alone) * c / statistics.median(batched):.2f} | "
              f"{(merged - sent) / merged:.0%} |")
    return 0


async def _groups(requests, c, Scheduler, BatchLimits, Job, Metrics, registry, encode):  # noqa: N803
    """Each group of `c` requests queued while the batcher is held, then let go: (seconds a group,
    runs a group, layouts a group) of the groups after the first four."""
    metrics = Metrics()
    model = requests[0].model
    scheduler = Scheduler([registry.get(n) for n in registry.names()], BatchLimits(), 1, metrics)
    scheduler.start()
    batcher = scheduler.batcher_for(model)
    family = metrics.batch_requests.labels(model.name)
    seconds, runs, layouts = [], [], []
    try:
        for g in range(len(requests) // c):
            group = requests[g * c:(g + 1) * c]
            batcher.stepping = True  # held, as while it runs a batch: the group queues
            tasks = [asyncio.ensure_future(scheduler.submit(Job(r, time.monotonic() + 60, encode))) for r in group]
            await asyncio.sleep(0)
            before = sum(b.get() for b in family._buckets)
            start = time.perf_counter()
            batcher.stepping = False
            batcher.wake()
            await asyncio.gather(*tasks)
            took = time.perf_counter() - start
            if g >= 4:
                seconds.append(took)
                runs.append(sum(b.get() for b in family._buckets) - before)
                layouts.append(len({tuple(a.shape for a in r.feed.values()) for r in group}))
    finally:
        await scheduler.stop()
    return seconds, runs, layouts


if __name__ == "__main__":
    sys.exit(main())
