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
    compute_input/infer/   the batch's run (service.core.batching.run_batch): merging the requests' arrays,
    compute_output         the session run, slicing and encoding every answer; each request of the batch is
                           charged its batch's durations, as Triton does; per batch size in batch_stats
    inference_count        rows (batch elements) run; execution_count: session runs

The request path pays a few integer additions: the stamps are the ones the Prometheus metrics take.
The counters of a run are added under a lock (runs of one model may be on several inference threads at
once); everything else is added on the event loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_NS = 1_000_000_000


class ModelStatistics:
    """The counters of one model version since it was loaded: integers, durations in nanoseconds."""

    __slots__ = ("last_inference_ms", "success_count", "success_ns", "fail_count", "fail_ns", "queue_count",
                 "queue_ns", "compute_count", "input_ns", "infer_ns", "output_ns", "inference_count",
                 "execution_count", "batches", "_lock")

    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.success_count = self.success_ns = 0
        self.fail_count = self.fail_ns = 0
        self.queue_count = self.queue_ns = 0
        self.compute_count = self.input_ns = self.infer_ns = self.output_ns = 0
        self.inference_count = self.execution_count = 0
        # batch size (rows of a session run) -> [runs, compute input ns, compute infer ns, compute output ns]
        self.batches: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def succeeded(self, seconds: float) -> None:
        self.success_count += 1
        self.success_ns += int(seconds * _NS)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def failed(self, seconds: float) -> None:
        self.fail_count += 1
        self.fail_ns += int(seconds * _NS)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def queued(self, requests: int, seconds: float) -> None:
        """`requests` taken from the queue into a batch, after `seconds` of waiting between them."""
        self.queue_count += requests
        self.queue_ns += int(seconds * _NS)

    def ran(self, requests: int, rows: int, input_s: float, infer_s: float, output_s: float) -> None:
        """One session run of `requests` requests, `rows` rows in all, and its three stages' seconds."""
        input_ns, infer_ns, output_ns = int(input_s * _NS), int(infer_s * _NS), int(output_s * _NS)
        with self._lock:
            self.execution_count += 1
            self.inference_count += rows
            self.compute_count += requests
            self.input_ns += requests * input_ns
            self.infer_ns += requests * infer_ns
            self.output_ns += requests * output_ns
            batch = self.batches.get(rows)
            if batch is None:
                batch = self.batches[rows] = [0, 0, 0, 0]
            batch[0] += 1
            batch[1] += input_ns
            batch[2] += infer_ns
            batch[3] += output_ns

    def report(self, name: str, version: str) -> dict[str, Any]:
        """Triton's `$model_stat` (its HTTP JSON; gRPC's ModelStatistics message has the same fields)."""
        with self._lock:
            compute, batches = self.compute_count, sorted((size, list(b)) for size, b in self.batches.items())
            input_ns, infer_ns, output_ns = self.input_ns, self.infer_ns, self.output_ns
            inference_count, execution_count = self.inference_count, self.execution_count

        def duration(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": inference_count,
            "execution_count": execution_count,
            "inference_stats": {
                "success": duration(self.success_count, self.success_ns),
                "fail": duration(self.fail_count, self.fail_ns),
                "queue": duration(self.queue_count, self.queue_ns),
                "compute_input": duration(compute, input_ns),
                "compute_infer": duration(compute, infer_ns),
                "compute_output": duration(compute, output_ns),
                # No response cache: always zero (perf_analyzer reads both).
                "cache_hit": duration(0, 0),
                "cache_miss": duration(0, 0),
            },
            "batch_stats": [{"batch_size": size, "compute_input": duration(runs, i), "compute_infer": duration(runs, n),
                             "compute_output": duration(runs, o)} for size, (runs, i, n, o) in batches],
        }
