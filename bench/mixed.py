"""What a batch of varied bodies costs: for each workload, groups of C requests from its pool
(bench/pools.py, the bodies `make bench` sends) queued together in their model's batcher, in process
(no HTTP, decoded beforehand), then let go; and the same group through a scheduler with batching off
(one run a request: the same queue, ATTEND_BATCHING=false), the two alternating group by group.

    python bench/mixed.py [--tree PATH] [--workloads W1,W3,W4,W5] [--concurrency 16] [--groups 24]

Per workload it prints: the layouts (distinct shapes) among a group's requests, the session runs the
batcher made of them, the padding (the share of the merged inputs' elements that are zeros added to
make a batch; outputs pad alike), the time from letting a group go to its last answer, a request
(merge, runs, slicing and encoding; runs on an inference thread included), batched and with batching
off, and the median over the groups of the ratio of the two (paired: a loaded machine slows both).
`--tree` measures another checkout's service (e.g. `git worktree add /tmp/base main`) on this
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
    from service.core import merge as merging
    from service.core.runtime import Registry
    from service.protocols.attend import decode_body

    padding: list[tuple[int, int]] = []  # (elements merged, elements the requests sent), a merged run
    merge = merging.merge

    def counted(model, jobs, *rest, **kw):
        feed = merge(model, jobs, *rest, **kw)
        if len(jobs) > 1:
            padding.append((sum(a.size for a in feed.values()),
                            sum(a.size for j in jobs for a in j.request.feed.values())))
        return feed

    merging.merge = counted  # run_batch looks it up in its module at each call
    registry = Registry.load(args.repository, "cpu", 1)
    c = args.concurrency
    print(f"service from {args.tree.resolve()}; {c} requests a group, {args.groups} groups a workload\n")
    print("| workload | layouts a group | runs a group | padding | us a request, batched | us a request, batching off "
          "| off / batched (paired median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.workloads.split(","):
        bodies = [json.dumps(b).encode() for b in WORKLOADS[name].bodies()]
        total = (4 + args.groups) * c
        bodies = (bodies * (total // len(bodies) + 1))[:total]
        requests = [decode_body(b, registry) for b in bodies]
        padding.clear()
        on, off, runs, layouts = asyncio.run(_groups(requests, c, batching, registry))
        merged = sum(m for m, _ in padding) or 1
        sent = sum(s for _, s in padding)
        print(f"| {name} | {statistics.mean(layouts):.1f} | {statistics.mean(runs):.1f} | "
              f"{(merged - sent) / merged:.0%} | {1e6 * statistics.median(on) / c:.0f} | "
              f"{1e6 * statistics.median(off) / c:.0f} | "
              f"{statistics.median(b / a for a, b in zip(on, off, strict=True)):.2f} |")
    return 0


async def _groups(requests, c, batching, registry):
    """Each group of `c` requests queued while a batcher is held, then let go: once batched, once with
    batching off. (seconds a group batched, the same with batching off, runs a group batched, layouts a
    group) of the groups after the first four."""
    from service.core.metrics import Metrics
    from service.protocols.attend import encode_attend

    model = requests[0].model
    schedulers = []
    for enabled in (True, False):
        metrics = Metrics()
        scheduler = batching.Scheduler([registry.get(n) for n in registry.names()],
                                       batching.BatchLimits(enabled=enabled), 1, metrics)
        scheduler.start()
        schedulers.append((scheduler, metrics.batch_requests.labels(model.name)))
    on, off, runs, layouts = [], [], [], []
    try:
        for g in range(len(requests) // c):
            group = requests[g * c:(g + 1) * c]
            for (scheduler, family), seconds in zip(schedulers, (on, off), strict=True):
                batcher = scheduler.batcher_for(model)
                batcher.stepping = True  # held, as while it runs a batch: the group queues
                tasks = [asyncio.ensure_future(scheduler.submit(batching.Job(r, time.monotonic() + 60, encode_attend)))
                         for r in group]
                await asyncio.sleep(0)
                before = sum(b.get() for b in family._buckets)
                start = time.perf_counter()
                batcher.stepping = False
                batcher.wake()
                await asyncio.gather(*tasks)
                took = time.perf_counter() - start
                if g >= 4:
                    seconds.append(took)
                    if seconds is on:
                        runs.append(sum(b.get() for b in family._buckets) - before)
            if g >= 4:
                layouts.append(len({tuple(a.shape for a in r.feed.values()) for r in group}))
    finally:
        for scheduler, _ in schedulers:
            await scheduler.stop()
    return on, off, runs, layouts


if __name__ == "__main__":
    sys.exit(main())
