"""Dynamic batching: a bounded queue per model, deadlines, and where each batch's run happens.

Concurrent requests for the same model merge into one session run (service.core.merge), whatever their
shapes, where the padding costs less than the runs it saves (service.core.runcost). Padding is exact:

- along the sequence axes: queries, keys and values are zero-padded to the batch's largest n_q and n_k;
  every request's 2-D valid lengths are at most its own n_k, so padded keys get weight exactly 0;
  padded query rows repeat their request's last length and are sliced off;
- along the feature sizes a graph leaves free: values' (dot_product, additive: zero columns, sliced off
  the outputs), and dot_product's d, zero-padded to the batch's largest D with each request's queries
  scaled by sqrt(D / d), so the graph's 1/sqrt(D) gives the book's q.k / sqrt(d). The positional
  encoding's d is not padded (P depends on it): requests group by it.

Where a batch runs: a hop to a thread costs more than a small run, so a batch predicted to run faster
than `inline_run_s` runs on the event loop; larger ones go to inference threads, so the loop keeps
reading and decoding meanwhile. A request alone in the server has nothing to overlap with: it runs on
the loop up to `alone_inline_run_s`. A batcher is woken by the first request in its queue and takes its
batch one loop iteration later, so the requests read in the same pass of the sockets merge with no wait.

With batching off the same queue runs batches of one request: the same admission, deadlines and
metrics, no merging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from service.core import tracing
from service.core.errors import ClientGone, DeadlineExceeded, Overloaded, ServiceError
from service.core.jobs import Encoder, Job, heads_of
from service.core.merge import product_sum, run_batch, run_terms
from service.core.metrics import Metrics
from service.core.runcost import RunCost
from service.core.runtime import LoadedModel

__all__ = ["BatchLimits", "Batcher", "Encoder", "Job", "Scheduler"]

log = logging.getLogger("service")


# What writing one number of an answer as JSON costs (orjson, a float32; measured on this project's machines).
# RunCost predicts the session run alone, and a large JSON answer takes far longer to write than to compute:
# a batch run on the event loop would hold it for that too.
_TEXT_S = 25e-9


@dataclass(frozen=True)
class BatchLimits:
    enabled: bool = True
    max_rows: int = 64  # sum of the requests' batch sizes
    max_elements: int = 4 * 1024 * 1024  # padded rows * heads * n_q * n_k: bounds the weights' memory
    max_wait_s: float = 0.0  # how long the first request waits for others to fill its batch
    max_queue: int = 256  # requests waiting (all models); more get 503 at once
    inline_run_s: float = 1e-3  # batches predicted to run faster than this run on the event loop
    alone_inline_run_s: float = 5e-3  # ... and a request alone in the server, faster than this


# Asking whether a client has gone: under `python -m service` a read of the connection's state, under
# another server a cancelled receive, which costs the event loop more: worth it for a request that has
# waited, not for one that just arrived.
_CHECK_CLIENT_AFTER_S = 0.002
# A batch being gathered waits at most this many times max_wait_s after its oldest request came.
_GATHER_CAP = 5
# A batch is looked for among at most this many requests it leaves queued (too costly to pad, or over
# a limit) besides those it takes: the queue is not searched end to end for every batch.
_PASSED = 64


class Batcher:
    """The queue of one model and the task that turns it into session runs."""

    def __init__(self, model: LoadedModel, limits: BatchLimits, scheduler: Scheduler):
        self.model = model
        self.limits = limits
        self.scheduler = scheduler
        self.metrics = scheduler.metrics.model(model.name)
        self.heads = heads_of(model)
        self.groups: dict[tuple, deque[Job]] = {}
        self._waiter: asyncio.Future | None = None  # the batcher's task, waiting for work
        self._gathering: asyncio.Future | None = None  # a batch waiting for more requests
        self._gather_target = 0
        self._gather_timer: asyncio.TimerHandle | None = None
        self._last_put = 0.0  # when the latest request joined the batch being gathered
        self.size = 0
        self.stepping = False  # the batcher's task is taking and running a batch
        self.running = 0  # batches on inference threads
        # What a run costs: whether a request's padding is worth a batch, and whether a batch runs inline.
        self.run_cost = RunCost(model.run_times)
        self._terms = run_terms(model)

    def put(self, job: Job) -> None:
        group = self.groups.get(job.key)
        if group is None:
            group = self.groups[job.key] = deque()
        group.append(job)
        self.size += 1
        if not self.stepping:
            self.wake()
        elif self._gathering is not None and not self._gathering.done():
            if self.size >= self._gather_target:
                self._gathering.set_result(None)  # the batch being gathered is as full as it can get
            else:
                self._last_put = job.enqueued  # still coming: the wait goes on (_gather)

    def wake(self) -> None:
        # A bare future on the cached loop, not asyncio.Event: Event looks the running loop up on
        # every wait, which on Python 3.11 costs a getpid() system call.
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _oldest_group(self) -> deque[Job]:
        return min((g for g in self.groups.values() if g), key=lambda g: g[0].enqueued)

    def _taken(self) -> None:
        """A job left the queue (to run, or answered already)."""
        self.size -= 1
        self.scheduler.queued -= 1


    async def _take(self) -> tuple[list[Job], int]:
        """The next batch, and the elements of its run: the group's oldest job, and those after it
        that fit within the limits and whose padding costs less than their own run would
        (`RunCost`); the others stay queued, in order. Drops jobs whose deadline passed or whose
        client is gone."""
        group = self._oldest_group()
        limits = self.limits
        if limits.enabled and limits.max_wait_s > 0:
            await self._gather(group)
        heads = self.heads
        batched, unbatched = self._terms
        pad_limit = self.run_cost.padding_limit()
        jobs: list[Job] = []
        passed: list[Job] = []  # looked at and left for a later batch
        rows = n_q = n_k = elements = per_row = extra = 0
        shape: tuple[int, ...] = ()
        now = time.monotonic()
        while group:
            job = group.popleft()
            if job.future.done():  # answered already: its deadline passed, or its caller went away
                self._taken()
                continue
            if job.deadline <= now:
                self._taken()
                job.future.set_exception(DeadlineExceeded("the request's deadline passed while it waited in the queue"))
                continue
            if job.is_disconnected is not None and now - job.enqueued > _CHECK_CLIENT_AFTER_S \
                    and await job.is_disconnected():
                self._taken()
                job.future.set_exception(ClientGone("the client disconnected"))
                continue
            if not jobs:
                rows, n_q, n_k, shape, elements = job.rows, job.n_q, job.n_k, job.shape, job.elements
                per_row, extra = product_sum(batched, shape), product_sum(unbatched, shape)
            elif not limits.enabled:
                passed.append(job)
                break
            else:
                r, q, k = rows + job.rows, max(n_q, job.n_q), max(n_k, job.n_k)
                if job.shape == shape:
                    wider, p, x = shape, per_row, extra
                else:
                    wider = tuple(map(max, shape, job.shape))
                    p, x = (per_row, extra) if wider == shape else (product_sum(batched, wider),
                                                                    product_sum(unbatched, wider))
                merged = r * p + x
                if r > limits.max_rows or r * heads * q * k > limits.max_elements \
                        or merged - elements - job.elements > pad_limit:
                    passed.append(job)
                    if rows >= limits.max_rows or len(passed) >= _PASSED:
                        break
                    continue
                rows, n_q, n_k, shape, elements, per_row, extra = r, q, k, wider, merged, p, x
            self._taken()
            jobs.append(job)
        group.extendleft(reversed(passed))
        if not group:
            for key in [k for k, g in self.groups.items() if not g]:
                del self.groups[key]
        return jobs, elements

    async def _gather(self, group: deque[Job]) -> None:
        """Wait for more requests to join while fewer are queued than the server has busy clients
        (service.http.guard.BusyConnections: the connections that began a request lately, not idle
        ones): they may be about to send. The wait ends `max_wait_s` after the latest request joined
        (requests still come in one after another as the loop decodes them; a wait counted from the first
        gathered fewer: `python bench/batch_wait.py`), and at most `_GATHER_CAP` times
        `max_wait_s` after the oldest came. A server that says it has no other busy client is not
        waited for; one that does not say (a test client) is waited for until requests stop coming."""
        busy = self.scheduler.busy_clients
        target = len(busy) if busy is not None else 1 << 30
        max_wait = self.limits.max_wait_s
        now = time.monotonic()
        rows = sum(j.rows for j in group)
        head = group[0]
        # A batch that could not take another request like its first does not wait for one (W2, 131K
        # weight elements a request against a limit of 128K, would only lose the wait).
        full = 2 * rows * self.heads * head.n_q * head.n_k > self.limits.max_elements
        cap = head.enqueued + _GATHER_CAP * max_wait
        if min(group[-1].enqueued + max_wait, cap) <= now or self.size >= target or rows >= self.limits.max_rows \
                or full:
            return
        loop = self.scheduler.loop
        gathering = self._gathering = loop.create_future()
        self._gather_target, self._last_put = target, group[-1].enqueued
        # A method and its arguments, not a closure: a closure that re-arms its own timer refers to
        # itself, a reference cycle a batch, left to the garbage collector.
        self._gather_timer = loop.call_later(max(self._last_put + max_wait - now, 0), self._expire, gathering,
                                             max_wait, cap)
        try:
            await gathering
        finally:
            self._gather_timer.cancel()
            self._gather_timer = None
            self._gathering = None

    def _expire(self, gathering: asyncio.Future, max_wait: float, cap: float) -> None:
        """The gathering's timer: the wait ends `max_wait` after the latest request joined, at `cap` at most."""
        if gathering.done():
            return
        now = time.monotonic()
        end = min(self._last_put + max_wait, cap)
        if now >= end:
            gathering.set_result(None)
        else:  # uvloop counts whole milliseconds: at least one, not a spin through the loop
            self._gather_timer = self.scheduler.loop.call_later(max(end - now, 1e-3), self._expire, gathering,
                                                                max_wait, cap)

    def _inline(self, elements: int, limit: float, text: int = 0) -> bool:
        """Whether a run of this many elements, and the encode of `text` numbers of its answers as JSON, is
        predicted to take less than `limit` seconds."""
        cost = self.run_cost
        return cost.known and cost.predict(elements) + text * _TEXT_S < limit

    def _observe(self, jobs: list[Job]) -> None:
        metrics = self.metrics
        start = time.monotonic()
        waited = 0.0
        for job in jobs:
            metrics.queue_time.observe(start - job.enqueued)
            waited += start - job.enqueued
        self.model.statistics.queued(len(jobs), waited)
        if tracing.on:
            tracing.dequeued(jobs, start)
        metrics.batch_requests.observe(len(jobs))
        metrics.batch_rows.observe(sum(j.rows for j in jobs))

    @staticmethod
    def _deliver(jobs: list[Job], results: list[Any] | None, error: BaseException | None) -> None:
        for i, job in enumerate(jobs):
            if not job.future.done():
                if error is None:
                    result = results[i]  # type: ignore[index]
                    if isinstance(result, ServiceError):  # this job's own refusal (merge.run_batch)
                        job.future.set_exception(result)
                    else:
                        job.future.set_result(result)
                else:
                    job.future.set_exception(error)

    async def step(self) -> None:
        """Take the next batch and run it: on the loop when it is short, else on an inference
        thread (this returns once the thread has it)."""
        scheduler = self.scheduler
        jobs, elements = await self._take()
        if scheduler.depth_gauge is not None:
            scheduler.depth_gauge.set(scheduler.queued)
        if not jobs:
            return
        self._observe(jobs)
        if self._inline(elements, self.limits.inline_run_s, sum([job.text for job in jobs])):
            try:
                results, seconds = run_batch(self.model, jobs, scheduler.metrics)
            except Exception as e:
                self._deliver(jobs, None, e)
            else:
                self.run_cost.observe(elements, seconds)
                self._deliver(jobs, results, None)
        else:
            await scheduler.threads.acquire()
            self.running += 1
            scheduler.spawn(self._in_thread(jobs, elements))

    def run_alone(self, job: Job) -> Any:
        """`job` at once, in the caller's task, with no queue: for a request the server says is the
        only one in progress (nothing could join its batch) and whose run is short."""
        if job.deadline <= time.monotonic():
            raise DeadlineExceeded("the request's deadline passed before it could run")
        self._observe([job])
        results, seconds = run_batch(self.model, [job], self.scheduler.metrics)
        self.run_cost.observe(job.elements, seconds)
        if isinstance(results[0], ServiceError):  # its own refusal (an output it could not write: service.core.shm)
            raise results[0]
        return results[0]

    async def loop(self) -> None:
        scheduler = self.scheduler
        while True:
            while not self.size or self.stepping:
                self._waiter = scheduler.loop.create_future()
                await self._waiter
            self.stepping = True
            try:
                await self.step()
            finally:
                self.stepping = False
            await asyncio.sleep(0)  # the callers of this batch answer; new requests join the next one

    async def _in_thread(self, jobs: list[Job], elements: int) -> None:
        scheduler = self.scheduler
        try:
            results, seconds = await scheduler.loop.run_in_executor(
                scheduler.executor, run_batch, self.model, jobs, scheduler.metrics)
        except Exception as e:
            self._deliver(jobs, None, e)
        else:
            self.run_cost.observe(elements, seconds)
            self._deliver(jobs, results, None)
        finally:
            self.running -= 1
            scheduler.threads.release()


class Scheduler:
    """Every model's batcher, the shared bound on queued requests, and the inference threads."""

    def __init__(self, models: list[LoadedModel], limits: BatchLimits, threads: int, metrics: Metrics):
        self.limits = limits
        self.metrics = metrics
        self.threads = asyncio.Semaphore(threads)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="inference")
        self.queued = 0
        # The queue-depth gauge: read at scrape time from `queued`; with workers, set as it changes.
        self.depth_gauge = metrics.track_queue_depth(lambda: self.queued)
        # The HTTP server's busy clients, where it tells (python -m service: a BusyConnections):
        # how many requests a batch can expect at most.
        self.busy_clients: Sized | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        # One batcher (a queue and its task) per snapshot being served: a new version gets its own,
        # and a retired one drains what it holds, then goes.
        # By snapshot (its id): a version loaded again in place has a batcher of its own beside the old one's.
        self.batchers: dict[int, Batcher] = {}
        self._loops: dict[int, asyncio.Task] = {}
        self._models = list(models)
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        """In the event loop that will serve: it is looked up once, here (on Python 3.11 every
        asyncio.get_running_loop() costs a getpid() system call)."""
        self.loop = asyncio.get_running_loop()
        for model in self._models:
            self.batcher_for(model)

    def batcher_for(self, model: LoadedModel) -> Batcher:
        """The batcher of this snapshot, made (with its task) the first time it is asked for."""
        key = id(model)
        batcher = self.batchers.get(key)
        if batcher is None or batcher.model is not model:
            batcher = self.batchers[key] = Batcher(model, self.limits, self)
            task = self._loops[key] = self.loop.create_task(batcher.loop())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return batcher

    async def retire(self, model: LoadedModel, timeout: float) -> bool:
        """Let the snapshot's batcher finish what it holds (queued, and running on a thread), then
        stop it. False when that took longer than `timeout` (it is stopped anyway)."""
        key = id(model)
        batcher = self.batchers.get(key)
        if batcher is None or batcher.model is not model:
            return True
        end = self.loop.time() + timeout
        while (batcher.size or batcher.stepping or batcher.running) and self.loop.time() < end:
            await asyncio.sleep(0.005)
        drained = not (batcher.size or batcher.stepping or batcher.running)
        if self.batchers.get(key) is batcher:
            del self.batchers[key]
            self._loops.pop(key).cancel()
        return drained

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=False)

    async def submit(self, job: Job, alone: bool = False) -> Any:
        """Queue `job` and wait for its response body; 503 at once when the queue is full, 504
        when the deadline passes first. `alone`: no other request is in progress in the server."""
        if self.queued >= self.limits.max_queue:
            self.metrics.rejected.labels(job.request.model.name).inc()
            raise Overloaded(f"the queue is full ({self.limits.max_queue} requests waiting); retry shortly",
                             headers={"Retry-After": "1"})
        batcher = self.batcher_for(job.request.model)
        idle = not batcher.stepping and not batcher.size
        if idle and alone and batcher._inline(job.elements, self.limits.alone_inline_run_s, job.text):
            return batcher.run_alone(job)
        loop = self.loop
        job.future = future = loop.create_future()
        self.queued += 1
        if self.depth_gauge is not None:
            self.depth_gauge.set(self.queued)
        batcher.put(job)
        # A timer, not wait_for (a task per call): at the deadline the caller gets its 504 even if a
        # long run holds the batch; the batcher drops the job if it has not run yet.
        timer = loop.call_later(max(job.deadline - time.monotonic(), 0), _expire, future)
        try:
            return await future
        finally:
            timer.cancel()
            if not future.done():
                future.cancel()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("the request's deadline passed before its batch ran"))
