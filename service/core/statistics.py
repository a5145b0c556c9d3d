"""Triton's statistics extension, kept per loaded model version: what a session run and a request cost,
as `GET /v2/models[/{m}[/versions/{v}]]/stats` and gRPC's ModelStatistics report it (Triton's
`docs/protocol/extension_statistics.md`), and perf_analyzer reads for its server-side breakdown.

Each snapshot of a model (service.core.runtime.LoadedModel) holds its own `ModelStatistics`, as each of
Triton's loaded models does: a version loaded again starts from zero, an unloaded one is gone with its
numbers. Per process: with ATTEND_WORKERS > 1 each worker counts what it served.

Who counts what:

    success, fail          the Dataplane, as it answers a request or its error (`answered`, `failed`):
                           time from the request's arrival at the transport to its answer
    queue                  the batcher, as it takes a request from the queue into a batch
    compute_input/infer/   the batch's run (service.core.merge.run_batch): merging the requests' arrays,
    compute_output         the session run, slicing and encoding every answer; each request of the batch is
                           charged its batch's durations, as Triton does; per batch size in batch_stats
    inference_count        rows (batch elements) run; execution_count: session runs

The request path pays a few additions (durations are summed as float seconds, made integer nanoseconds
when read: over 10^8 requests the rounding stays under 10^-8 of the sum), and two clock reads a batch
beyond those the Prometheus metrics take. The counters of a run are added under a lock (runs of one
model may be on several inference threads at once); everything else is added on the event loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_NS = 1_000_000_000


class ModelStatistics:
    """The counters of one model version since it was loaded: counts, and durations in seconds (floats)."""

    __slots__ = ("last_inference", "success_count", "success_s", "fail_count", "fail_s", "queue_count", "queue_s",
                 "compute_count", "input_s", "infer_s", "output_s", "inference_count", "execution_count", "batches",
                 "_lock")

    def __init__(self) -> None:
        self.last_inference = 0.0  # time.perf_counter() of the latest session run's end or failure
        self.success_count, self.success_s = 0, 0.0
        self.fail_count, self.fail_s = 0, 0.0
        self.queue_count, self.queue_s = 0, 0.0
        self.compute_count, self.input_s, self.infer_s, self.output_s = 0, 0.0, 0.0, 0.0
        self.inference_count = self.execution_count = 0
        # batch size (rows of a session run) -> [runs, compute input s, compute infer s, compute output s]
        self.batches: dict[int, list[float]] = {}
        self._lock = threading.Lock()

    def succeeded(self, seconds: float) -> None:
        self.success_count += 1
        self.success_s += seconds

    def failed(self, seconds: float) -> None:
        self.fail_count += 1
        self.fail_s += seconds
        self.last_inference = time.perf_counter()

    def queued(self, requests: int, seconds: float) -> None:
        """`requests` taken from the queue into a batch, after `seconds` of waiting between them."""
        self.queue_count += requests
        self.queue_s += seconds

    def ran(self, requests: int, rows: int, input_s: float, infer_s: float, output_s: float, end: float) -> None:
        """One session run of `requests` requests, `rows` rows in all, its three stages' seconds, and when
        its answers were encoded (time.perf_counter())."""
        lock = self._lock
        lock.acquire()  # (not `with`: half the cost; nothing in here raises)
        try:
            self.last_inference = end
            self.execution_count += 1
            self.inference_count += rows
            self.compute_count += requests
            if requests == 1:
                self.input_s += input_s
                self.infer_s += infer_s
                self.output_s += output_s
            else:  # each request of the batch is charged the batch's durations
                self.input_s += requests * input_s
                self.infer_s += requests * infer_s
                self.output_s += requests * output_s
            batch = self.batches.get(rows)
            if batch is None:
                batch = self.batches[rows] = [0, 0.0, 0.0, 0.0]
            batch[0] += 1
            batch[1] += input_s
            batch[2] += infer_s
            batch[3] += output_s
        finally:
            lock.release()

    def report(self, name: str, version: str) -> dict[str, Any]:
        """Triton's `$model_stat` (its HTTP JSON; gRPC's ModelStatistics message has the same fields):
        counts and nanoseconds as integers, the version as a string."""
        with self._lock:
            compute, batches = self.compute_count, sorted((size, list(b)) for size, b in self.batches.items())
            input_s, infer_s, output_s = self.input_s, self.infer_s, self.output_s
            inference_count, execution_count = self.inference_count, self.execution_count

        def duration(count: float, seconds: float) -> dict[str, int]:
            return {"count": int(count), "ns": round(seconds * _NS)}

        return {
            "name": name,
            "version": version,
            # Milliseconds since the epoch (the wall clock's offset from perf_counter's read now, not a
            # clock read a request).
            "last_inference": int((self.last_inference + time.time() - time.perf_counter()) * 1000)
            if self.last_inference else 0,
            "inference_count": inference_count,
            "execution_count": execution_count,
            "inference_stats": {
                "success": duration(self.success_count, self.success_s),
                "fail": duration(self.fail_count, self.fail_s),
                "queue": duration(self.queue_count, self.queue_s),
                "compute_input": duration(compute, input_s),
                "compute_infer": duration(compute, infer_s),
                "compute_output": duration(compute, output_s),
                # No response cache: always zero (perf_analyzer reads both).
                "cache_hit": duration(0, 0),
                "cache_miss": duration(0, 0),
            },
            "batch_stats": [{"batch_size": size, "compute_input": duration(runs, i), "compute_infer": duration(runs, n),
                             "compute_output": duration(runs, o)} for size, (runs, i, n, o) in batches],
        }
