"""The work of one request, with no HTTP in it: decode -> queue (batching, deadline) -> run -> encode.

The protocols' codecs (service/routes/attend.py for /attend) decode their bodies into a `Request`
and hand it here with an encoder of their own; the batching, the limits and the metrics are here,
once, below every codec. `attend` does decode, run and encode in a row in the calling thread: the
in-process benchmark, and callers without a queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import orjson

from service.batching import Encoder, Job, Scheduler
from service.decode import Request, RequestLimits, decode_body
from service.errors import DeadlineExceeded
from service.metrics import Metrics
from service.runtime import LoadedModel, Registry

_ORJSON = orjson.OPT_SERIALIZE_NUMPY
T = TypeVar("T")


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def encode_attend(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool = True) -> bytes:
    """/attend's response body: the model, `outputs`, `attention_weights` (null when not asked for,
    or for a model without), and any other output of the model (`P` of the positional encoding)."""
    body: dict[str, Any] = {"model": model.name, "outputs": outputs["outputs"],
                            "attention_weights": outputs.get("attention_weights") if return_weights else None}
    if len(outputs) > 2 or "attention_weights" not in outputs:
        body.update((name, value) for name, value in outputs.items() if name not in body)
    return orjson.dumps(body, option=_ORJSON)


class Dataplane:
    def __init__(self, registry: Registry, metrics: Metrics, limits: RequestLimits | None = None,
                 scheduler: Scheduler | None = None, decode_threads: int = 1, inline_decode_bytes: int = 1 << 20):
        self.registry = registry
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.scheduler = scheduler
        self.inline_decode_bytes = inline_decode_bytes
        self.in_flight = 0  # requests between their codec's start and end (the in-flight gauge reads it)
        self.served_since_trim = 0  # requests since the heap was last trimmed (service.app)
        # The HTTP server's set of requests in progress, where it tells (uvicorn run by python -m
        # service): a request that is the only one has nobody to wait for to share a batch.
        self.server_tasks: set | None = None
        self._decoder = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") if scheduler else None

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)

    def decode(self, body: bytes) -> Request:
        """/attend's body -> Request. Raises ServiceError subclasses for bad input, with `.model`
        set to the model's name once it is known (for the metrics' label)."""
        return decode_body(body, self.registry, self.limits)

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

    async def infer(self, request: Request, deadline: float, encode: Encoder = encode_attend,
                    is_disconnected: Any = None) -> Any:
        """The encoded response for `request`, through the batching queue."""
        assert self.scheduler is not None
        tasks = self.server_tasks
        return await self.scheduler.submit(Job(request, deadline, encode, is_disconnected),
                                           alone=tasks is not None and len(tasks) <= 1)

    def attend(self, body: bytes) -> bytes:
        """Decode, run and encode one request, in the calling thread."""
        request = self.decode(body)
        model = request.model
        start = time.perf_counter()
        outputs = model.run(request.feed)
        self.metrics.model(model.name).inference.observe(time.perf_counter() - start)
        return encode_attend(model, outputs, request.return_weights)
