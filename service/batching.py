"""Dynamic batching, a bounded queue and deadlines.

Concurrent requests for the same model are merged into one session run. Padding is exact
because of the masking: queries, keys and values are zero-padded to the batch's largest n_q and
n_k, and every request's 2-D valid lengths (its own, or its n_k where it sent none) are at most
its own n_k, so padded keys get weight exactly 0; padded query rows get length 0 and are sliced
off. Each request gets back exactly its own rows, queries and keys.

Requests are grouped by feature sizes (dot_product accepts any) and by length bucket (the
power of two at or above n_q and n_k), so one long request does not make many short ones pay
for padding, and ONNX Runtime sees a bounded set of shapes.

With batching off the same queue runs batches of one request: the same admission, deadlines
and metrics, no merging.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from service.dataplane import encode
from service.decode import Request
from service.errors import ClientGone, DeadlineExceeded, Overloaded
from service.metrics import Metrics
from service.runtime import LoadedModel


@dataclass(frozen=True)
class BatchLimits:
    enabled: bool = True
    max_rows: int = 64  # sum of the requests' batch sizes
    max_elements: int = 4 * 1024 * 1024  # padded rows * heads * n_q * n_k: bounds the weights' memory
    max_wait_s: float = 0.0  # how long the first request waits for others to fill its batch
    max_queue: int = 256  # requests waiting (all models); more get 503 at once


# Asking whether a client has gone costs a cancelled receive (~10-20 us on the event loop): worth it
# for a request that has waited, not for one that just arrived.
_CHECK_CLIENT_AFTER_S = 0.002


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(eq=False)
class Job:
    request: Request
    deadline: float  # time.monotonic()
    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    enqueued: float = field(default_factory=time.monotonic)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def rows(self) -> int:
        return int(self.request.feed["valid_lens"].shape[0])

    @property
    def n_q(self) -> int:
        return int(self.request.feed["valid_lens"].shape[1])

    @property
    def n_k(self) -> int:
        feed = self.request.feed
        return int(feed["keys"].shape[1]) if "keys" in feed else self.n_q

    def key(self) -> tuple:
        features = tuple(a.shape[-1] for name, a in self.request.feed.items() if name != "valid_lens")
        return features, bucket(self.n_q), bucket(self.n_k)


def _heads(model: LoadedModel) -> int:
    return int(model.config.hyperparameters.get("num_heads", 1))


def merge(model: LoadedModel, jobs: list[Job]) -> dict[str, np.ndarray]:
    """One feed for every job: zero-padded to the largest n_q / n_k, stacked along batch."""
    if len(jobs) == 1:
        return jobs[0].request.feed
    n_q, n_k = max(j.n_q for j in jobs), max(j.n_k for j in jobs)
    rows = sum(j.rows for j in jobs)
    sizes = {"n_q": n_q, "n_k": n_k, "n": n_q}
    feed: dict[str, np.ndarray] = {}
    for spec in model.inputs():
        first = jobs[0].request.feed[spec.name]
        if spec.name == "valid_lens":
            merged = np.zeros((rows, n_q), dtype=np.int64)  # padded queries: length 0
        else:
            merged = np.zeros((rows, sizes[spec.shape[1]], first.shape[2]), dtype=np.float32)
        r = 0
        for job in jobs:
            part = job.request.feed[spec.name]
            merged[r:r + part.shape[0], :part.shape[1]] = part
            r += part.shape[0]
        feed[spec.name] = merged
    return feed


def run_batch(model: LoadedModel, jobs: list[Job], metrics: Metrics) -> list[bytes]:
    """Merge, run once, slice each job's rows, queries and keys back out, encode. In a thread."""
    feed = merge(model, jobs)
    start = time.perf_counter()
    outputs, weights = model.run(feed)
    metrics.inference.labels(model.name).observe(time.perf_counter() - start)
    if len(jobs) == 1:
        job = jobs[0]
        return [encode(model.name, outputs, weights if job.request.return_weights else None)]
    results, r = [], 0
    for job in jobs:
        out = np.ascontiguousarray(outputs[r:r + job.rows, :job.n_q])
        w = np.ascontiguousarray(weights[r:r + job.rows, ..., :job.n_q, :job.n_k]) if job.request.return_weights \
            else None
        results.append(encode(model.name, out, w))
        r += job.rows
    return results


class Batcher:
    """The queue of one model and the task that turns it into session runs."""

    def __init__(self, model: LoadedModel, limits: BatchLimits, scheduler: Scheduler):
        self.model = model
        self.limits = limits
        self.scheduler = scheduler
        self.groups: dict[tuple, deque[Job]] = {}
        self.wakeup = asyncio.Event()
        self.size = 0

    def put(self, job: Job) -> None:
        self.groups.setdefault(job.key(), deque()).append(job)
        self.size += 1
        self.wakeup.set()

    def _oldest_group(self) -> deque[Job]:
        return min((g for g in self.groups.values() if g), key=lambda g: g[0].enqueued)

    def _pop(self, group: deque[Job]) -> Job:
        self.size -= 1
        self.scheduler.queued -= 1
        return group.popleft()

    async def _take(self) -> list[Job]:
        """The next batch: jobs of the group with the oldest head, within the limits; drops jobs
        whose deadline passed or whose client is gone."""
        group = self._oldest_group()
        limits = self.limits
        if limits.enabled and limits.max_wait_s > 0:
            wait = group[0].enqueued + limits.max_wait_s - time.monotonic()
            if wait > 0 and sum(j.rows for j in group) < limits.max_rows:
                await asyncio.sleep(wait)
        heads = _heads(self.model)
        jobs: list[Job] = []
        rows = n_q = n_k = 0
        now = time.monotonic()
        while group:
            job = group[0]
            if job.future.done():  # the client's wait timed out already
                self._pop(group)
                continue
            if job.deadline <= now:
                self._pop(group).future.set_exception(
                    DeadlineExceeded("the request's deadline passed while it waited in the queue"))
                continue
            if job.is_disconnected is not None and now - job.enqueued > _CHECK_CLIENT_AFTER_S \
                    and await job.is_disconnected():
                self._pop(group).future.set_exception(ClientGone("the client disconnected"))
                continue
            if jobs:
                if not limits.enabled:
                    break
                r, q, k = rows + job.rows, max(n_q, job.n_q), max(n_k, job.n_k)
                if r > limits.max_rows or r * heads * q * k > limits.max_elements:
                    break
            jobs.append(self._pop(group))
            rows, n_q, n_k = rows + job.rows, max(n_q, job.n_q), max(n_k, job.n_k)
        for key in [k for k, g in self.groups.items() if not g]:
            del self.groups[key]
        return jobs

    async def loop(self) -> None:
        scheduler = self.scheduler
        while True:
            while not self.size:
                self.wakeup.clear()
                await self.wakeup.wait()
            await scheduler.slots.acquire()  # a free inference slot; meanwhile the queue fills
            try:
                jobs = await self._take()
            except BaseException:
                scheduler.slots.release()
                raise
            if not jobs:
                scheduler.slots.release()
                continue
            scheduler.metrics.queue_depth.set(scheduler.queued)
            scheduler.spawn(self._execute(jobs))

    async def _execute(self, jobs: list[Job]) -> None:
        metrics = self.scheduler.metrics
        start = time.monotonic()
        for job in jobs:
            metrics.queue_time.labels(self.model.name).observe(start - job.enqueued)
        metrics.batch_requests.labels(self.model.name).observe(len(jobs))
        metrics.batch_rows.labels(self.model.name).observe(sum(j.rows for j in jobs))
        try:
            results = await anyio.to_thread.run_sync(run_batch, self.model, jobs, metrics,
                                                     limiter=self.scheduler.threads)
        except Exception as e:
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(e)
        else:
            for job, result in zip(jobs, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)
        finally:
            self.scheduler.slots.release()


class Scheduler:
    """Every model's batcher, the shared bound on queued requests and the inference slots."""

    def __init__(self, models: list[LoadedModel], limits: BatchLimits, slots: int, metrics: Metrics):
        self.limits = limits
        self.metrics = metrics
        self.slots = asyncio.Semaphore(slots)
        self.threads = anyio.CapacityLimiter(slots)
        self.queued = 0
        self.batchers = {m.name: Batcher(m, limits, self) for m in models}
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        for batcher in self.batchers.values():
            self.spawn(batcher.loop())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def submit(self, job: Job) -> bytes:
        """Queue `job` and wait for its response body; 503 at once when the queue is full, 504
        when the deadline passes first."""
        if self.queued >= self.limits.max_queue:
            self.metrics.rejected.labels(job.request.model.name).inc()
            raise Overloaded(f"the queue is full ({self.limits.max_queue} requests waiting); retry shortly",
                             headers={"Retry-After": "1"})
        self.queued += 1
        self.metrics.queue_depth.set(self.queued)
        self.batchers[job.request.model.name].put(job)
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), max(job.deadline - time.monotonic(), 0))
        except TimeoutError:
            job.future.cancel()  # the batcher drops it if it has not run yet
            raise DeadlineExceeded("the request's deadline passed before its batch ran") from None
