"""What Triton's statistics extension (service/core/statistics.py) adds to a request, against what the
request costs: the book's toy request (additive, W1's body) running alone, in-process, one core.

    python bench/statistics_cost.py [--repository model_repository] [--requests 2000] [--rounds 8]

1. The core's path of the request, in CPU time (time.thread_time, ONNX Runtime on this thread: one intra-op
   thread): Job, the scheduler's submit (alone: run_alone, i.e. _observe, run_batch, _learn) and
   Dataplane.answered; the median and least of the rounds.
2. The statements the statistics add to that path, replayed by themselves (timeit, the least of 9): the two
   stamps and the record of run_batch (`ran`), the queue's sum in Batcher._observe, the success in
   Dataplane.answered. A replay: kept beside the code it copies, checked by reading.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from service.config import Settings  # noqa: E402
from service.core.batching import Job  # noqa: E402
from service.core.dataplane import Dataplane  # noqa: E402
from service.core.merge import ran  # noqa: E402
from service.http.schemas import toy_request  # noqa: E402
from service.protocols.attend import decode_body  # noqa: E402


async def core_path(repository: Path, requests: int, rounds: int) -> tuple[list[float], Job]:
    dataplane = Dataplane(Settings(model_repository=repository, device="cpu", intra_op_threads=1))
    await dataplane.open()
    request = decode_body(orjson.dumps(toy_request()), dataplane.registry)
    submit, answered, model = dataplane.scheduler.submit, dataplane.answered, request.model

    def encode(model, outputs, weights):
        return outputs

    per_request = []
    for r in range(rounds + 1):  # the first round warms up
        start = time.thread_time()
        for _ in range(requests):
            await submit(Job(request, time.monotonic() + 30, encode), alone=True)
            answered(model.name, 200, 1e-4, model)
        if r:
            per_request.append((time.thread_time() - start) / requests)
    await dataplane.close()
    return per_request, Job(request, time.monotonic() + 30, encode)


def added_statements(job: Job) -> float:
    model, jobs, results = job.request.model, [job], [None]

    def added() -> None:
        begun = time.perf_counter()  # run_batch
        ran(model, jobs, results, begun, begun, 2e-5)  # (where it returned `results, seconds` before)
        waited = 0.0  # Batcher._observe
        waited += begun - job.enqueued
        model.statistics.queued(len(jobs), waited)
        snapshot = model  # Dataplane.answered
        if snapshot is None:
            pass
        snapshot.statistics.succeeded(1e-4)

    def before() -> tuple:
        return results, 2e-5

    n = 100_000
    return (min(timeit.repeat(added, number=n, repeat=9)) - min(timeit.repeat(before, number=n, repeat=9))) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    per_request, job = asyncio.run(core_path(args.repository, args.requests, args.rounds))
    added = added_statements(job)
    median, least = statistics.median(per_request), min(per_request)
    print(f"core path of a toy request alone: {median * 1e6:.1f} us of CPU (median of {args.rounds} rounds of "
          f"{args.requests}), least {least * 1e6:.1f} us")
    print(f"statements the statistics add to it: {added * 1e9:.0f} ns ({added / least:.1%} of the least round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
