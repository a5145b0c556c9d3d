"""One inference request's life, the same for every transport: `serve(core, exchange)`.

A transport reads what it can of a request (its target, headers, key, deadline) into an `Exchange`,
and calls `serve`. The core admits it, sets its deadline, holds its cost, has the transport read the
body, decodes it (inline or on a thread), runs it through the batching, counts the outcome, releases the
cost, and writes the access log line. The transport only turns the `Answer`, or the error, into bytes
or a status (`Exchange.send`, `Exchange.refuse`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from service.core import tracing
from service.core.batching import Encoder
from service.core.cost import Cost
from service.core.errors import ServiceError
from service.core.logs import log_access, request_id
from service.core.request import Request
from service.core.shm import Offload

if TYPE_CHECKING:
    from service.core.dataplane import Dataplane
    from service.core.runtime import LoadedModel

log = logging.getLogger("service")

Target = tuple[str | None, str | None]  # (model, version) from the route or the message; None: the body says
Headers = dict[Any, Any]  # what the codec reads: HTTP headers (lower-case bytes), gRPC metadata


class Answer(NamedTuple):
    """What every codec's encoder makes of a run's outputs."""

    body: Any  # bytes, a list of parts (HTTP), or a message (gRPC)
    headers: list[tuple[bytes, bytes]]  # extra headers (the model's version)
    content_type: bytes
    model: LoadedModel  # the version that answered (the batch's snapshot)


class Codec(Protocol):
    """A protocol's codec: bytes (or a message) in, a `Request` and its encoder out; errors in its own body.
    It knows no connection: the transport and `serve` do the rest."""

    def check_media_type(self, headers: Headers) -> None:
        """Raise UnsupportedMediaType for a body this protocol does not read."""

    def expected(self, headers: Headers, length: int) -> int:
        """What decoding a body of `length` bytes will hold at least, known from the headers alone."""

    def aligned_at(self, headers: Headers) -> int | None:
        """Where a body read in place should be 64-byte aligned (None: it takes bytes)."""

    def decode(self, core: Any, target: Target, headers: Headers, body: Any, cost: Cost
               ) -> tuple[Request, Encoder]:
        """The request and its answer's encoder (which returns an `Answer`). What the decode holds is held
        in `cost` first. Raises ServiceError, with `.model` set once the model is known."""

    def error_body(self, error: ServiceError) -> bytes:
        """The protocol's error body for `error`."""


class Exchange(Protocol):
    """One inference request, as its transport read it."""

    protocol: str  # the metrics' label: "http", "grpc"
    method: str  # the access log's
    codec: Codec
    target: Target
    headers: Headers
    authorization: bytes | None
    timeout_ms: bytes | str | None  # X-Request-Timeout-Ms
    arrived: float | None  # time.monotonic() when it arrived, where the transport knows
    rid: str  # the request ID
    disconnected: Any  # an async probe: has the client gone? (None: the transport cannot tell)

    def latest(self) -> float | None:
        """The transport's own deadline (gRPC's grpc-timeout), or None."""

    def path(self, model: str) -> str:
        """What the access log line names."""

    async def body(self, cost: Cost, until: float) -> Any:
        """The body, read and held in `cost` as it comes (what runs on a thread, not past `until`);
        `cost.base` set to its size in bytes."""

    def cancelled(self) -> ServiceError:
        """What the request's cancellation means (its client went away, its deadline passed)."""

    async def send(self, answer: Answer) -> None:
        """Write the answer."""

    async def refuse(self, error: ServiceError) -> None:
        """Write the error (it may raise: gRPC ends the call so)."""


def label(core: Dataplane, name: str | None) -> str:
    """A model's metrics label before the body is decoded: only models that exist have one ("-" otherwise:
    a client's made-up names must not grow the metrics)."""
    return name if name is not None and core.registry.get(name) is not None else "-"


async def serve(core: Dataplane, x: Exchange) -> int:
    """The request's status once answered (0: the client went away, nothing was sent)."""
    start = time.perf_counter()
    token = request_id.set(x.rid)
    trace = tracing.begin(x, core.trace_settings) if tracing.on else None
    stamps = trace if trace is not None and trace.recording else None  # its stages kept (sampled)
    outcome = ["-", 500]  # the model's label and the status, for the access log line
    try:
        try:
            core.admit(x.authorization)
        except ServiceError as e:
            outcome[1] = core.failed("-", e, protocol=x.protocol)
            if stamps is not None:
                stamps.error = e
            await x.refuse(e)
            return outcome[1]
        try:
            await _admitted(core, x, start, outcome, stamps)
        finally:
            core.release()
        return outcome[1]
    finally:
        log_access(x.method, x.path(outcome[0]), outcome[1], time.perf_counter() - start,
                   None if trace is None else trace.ids)
        if trace is not None:
            tracing.end(trace, x, outcome[1])
        request_id.reset(token)


async def _admitted(core: Dataplane, x: Exchange, start: float, outcome: list, stamps: tracing.RequestTrace | None
                    ) -> None:
    """`stamps`: the request's trace, where it is sampled: each stage's times go on it."""
    codec = x.codec
    model = outcome[0] = label(core, x.target[0])
    version: int | str | None = x.target[1]  # for the statistics: the version asked for, then the one decoded
    cost = core.cost()
    try:
        codec.check_media_type(x.headers)
        arrived = x.arrived if x.arrived is not None else time.monotonic()
        until = core.deadline(x.timeout_ms, arrived)
        latest = x.latest()
        if latest is not None and latest < until:
            until = latest
        with core.within(until):
            if stamps is not None:
                stamps.read = (time.perf_counter(), 0.0)
            body = await x.body(cost, until)
            if stamps is not None:
                stamps.read, stamps.body_bytes = (stamps.read[0], time.perf_counter()), cost.base  # type: ignore[index]
            if cost.base > core.inline_decode_bytes:
                # While it waits for a thread: the body, and what its decode will hold at least.
                cost.hold(cost.base + codec.expected(x.headers, cost.base), "this body")
                if stamps is not None:
                    stamps.decode, stamps.where = (time.perf_counter(), 0.0), "thread"
                request, encode = await core.in_thread(until, codec.decode, core, x.target, x.headers, body, cost)
            else:  # a thread hop costs more than a small body's decode
                if stamps is not None:
                    stamps.decode = (time.perf_counter(), 0.0)
                held = cost.held
                try:
                    request, encode = codec.decode(core, x.target, x.headers, body, cost)
                except Offload:  # a small body that names more shared memory than the loop may read
                    cost.hold(held)
                    if stamps is not None:
                        stamps.where = "thread"
                    request, encode = await core.in_thread(until, codec.decode, core, x.target, x.headers, body, cost)
            if stamps is not None:
                stamps.decode = (stamps.decode[0], time.perf_counter())  # type: ignore[index]
        model = outcome[0] = request.model.name
        version = request.model.config.version
        if request.timeout_s is not None and arrived + request.timeout_s < until:
            until = arrived + request.timeout_s
        answer = await core.infer(request, until, encode, x.disconnected, cost, stamps)
    except ServiceError as e:
        # Its traceback holds the frames it passed through, and they what they held: the body, its
        # decode. A future that delivered it (a decode thread's, a batch's) is among those frames' locals,
        # and holds it: a cycle only a full collection, rare, would free. Dropped, they go now.
        e.__traceback__ = None
        cost.release()
        outcome[1] = core.failed(e.model or model, e, time.perf_counter() - start, version, x.protocol)
        if stamps is not None:
            stamps.error = e
        if outcome[1]:
            await x.refuse(e)
        return
    except asyncio.CancelledError:  # the server or grpc ended the call: nothing is sent
        cost.release()
        error = x.cancelled()
        outcome[1] = core.failed(model, error, time.perf_counter() - start, version, x.protocol)
        if stamps is not None:
            stamps.error = error
        raise
    except Exception as e:
        cost.release()
        log.exception("unhandled error in %s %s", x.method, x.path(model)[:200])
        e.__traceback__ = None  # logged: as above
        error = ServiceError("internal server error")
        outcome[1] = core.failed(model, error, time.perf_counter() - start, version, x.protocol)
        if stamps is not None:
            stamps.error = error
        await x.refuse(error)
        return
    core.answered(model, 200, time.perf_counter() - start, answer.model, x.protocol)
    outcome[1] = 200
    try:
        if stamps is None:
            await x.send(answer)
        else:
            stamps.write = (time.perf_counter(), 0.0)
            await x.send(answer)
            stamps.write = (stamps.write[0], time.perf_counter())
    finally:
        cost.release()  # the answer is written (or handed to the socket's buffer)
