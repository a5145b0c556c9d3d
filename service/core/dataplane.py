"""The work of one request, below every protocol: decode (inline or on a thread, within the
deadline) -> queue (batching, deadline) -> run -> encode; the API key check, readiness, and the
heap trimmed when idle.

The protocols' codecs (service/protocols: /attend's and the Open Inference Protocol's) decode their
bodies into a `Request` and hand it here with an encoder of their own; the batching, the limits and
the metrics are here, once, below every codec.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

from service.core.batching import Encoder, Job, Scheduler
from service.core.errors import DeadlineExceeded, NotReady, Unauthorized
from service.core.memory import trim_memory
from service.core.metrics import Metrics
from service.core.request import Request, RequestLimits
from service.core.runtime import Registry

T = TypeVar("T")


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class Dataplane:
    def __init__(self, registry: Registry, metrics: Metrics, limits: RequestLimits | None = None,
                 scheduler: Scheduler | None = None, decode_threads: int = 1, inline_decode_bytes: int = 1 << 20):
        self.registry = registry
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.scheduler = scheduler
        self.inline_decode_bytes = inline_decode_bytes
        self.in_flight = 0  # requests between their codec's start and end (the in-flight gauge reads it)
        self.served_since_trim = 0  # requests since the heap was last trimmed (_trim_memory_when_idle)
        # The HTTP server's set of requests in progress, where it tells (uvicorn run by python -m
        # service): a request that is the only one has nobody to wait for to share a batch.
        self.server_tasks: set | None = None
        self._decoder = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") if scheduler else None

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)

    async def decode_async(self, decode: Callable[[bytes], T], body: bytes, deadline: float) -> T:
        """`decode(body)` (a protocol's decoder), on the event loop for small bodies (a thread hop
        costs more than their parse), in a decode thread for large ones; never started once the
        deadline has passed, and a 504 at the deadline even while it waits for the thread."""
        if len(body) <= self.inline_decode_bytes:
            return decode(body)
        loop = asyncio.get_running_loop()

        def decode_unless_late() -> T:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("the request's deadline passed before its body could be decoded")
            return decode(body)

        future = loop.run_in_executor(self._decoder, decode_unless_late)
        # However this ends, nobody may be left to read the decode's result: say it is read.
        future.add_done_callback(_retrieved)
        timeout = deadline - time.monotonic()
        try:
            if timeout <= 0:
                raise DeadlineExceeded("the request's deadline passed before its body could be decoded")
            done, _ = await asyncio.wait((future,), timeout=timeout)
            if not done:
                raise DeadlineExceeded("the request's deadline passed before its body could be decoded")
        finally:
            if not future.done():
                future.cancel()  # still queued: never decoded; decoding: its result is dropped
        return future.result()

    async def infer(self, request: Request, deadline: float, encode: Encoder,
                    is_disconnected: Any = None) -> Any:
        """The encoded response for `request`, through the batching queue."""
        assert self.scheduler is not None
        tasks = self.server_tasks
        return await self.scheduler.submit(Job(request, deadline, encode, is_disconnected),
                                           alone=tasks is not None and len(tasks) <= 1)



def check_api_key(header: bytes | None, keys: tuple[bytes, ...]) -> None:
    """Raises Unauthorized unless `header` (the Authorization header's value) is `Bearer <one of keys>`."""
    scheme, _, token = (header or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise Unauthorized("this endpoint needs an API key: Authorization: Bearer <key>", field="Authorization",
                           headers={"WWW-Authenticate": "Bearer"})
    given = token.strip()
    # Compare with every key, no early exit: the time does not tell which key (or how much) matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    if not matched:
        raise Unauthorized("the API key is not valid", field="Authorization",
                           headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


def check_ready(state: object) -> None:
    """Ready: started, not stopping, and every model that should be served is (one that could not
    be loaded at start, kept out by ATTEND_SKIP_BROKEN_MODELS, is not; one unloaded on purpose does
    not count). Raises NotReady saying why."""
    if not state.ready:  # type: ignore[attr-defined]
        raise NotReady("not ready", headers={"Retry-After": "1"})
    broken = state.registry.broken  # type: ignore[attr-defined]
    if broken:
        raise NotReady(f"not ready: model(s) {', '.join(sorted(broken))} could not be loaded (GET /models says why)")


async def _trim_memory_when_idle(dataplane: Dataplane, every_s: float = 2.0) -> None:
    """After requests, once a whole period passed with none arriving and none in flight, give freed
    heap memory back to the system (glibc keeps it otherwise: 400-800 MB stayed resident after a
    burst of large bodies). Not under steady load: the next requests would fault the pages in again."""
    seen = 0
    while True:
        await asyncio.sleep(every_s)
        served = dataplane.served_since_trim
        if served and served == seen and not dataplane.in_flight:
            await anyio.to_thread.run_sync(trim_memory)
            dataplane.served_since_trim = served = 0
        seen = served
