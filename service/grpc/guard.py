"""What the HTTP connection guard (service.http.protocol) bounds before the app, bounded for gRPC: the calls
under way, a message that does not come, connections and streams.

grpc reads a unary call's whole message before its handler runs, and its own bound on calls
(`maximum_concurrent_rpcs`) counts a call from its first frame: streams that announce a message and then
stall held every slot for as long as their connections stayed open, and no call was served meanwhile.
So every method is registered here as a client-streaming one (the same bytes on the wire: a unary
request is a stream of one message): the handler runs when the call begins, is counted, reads the one
message within ATTEND_BODY_TIMEOUT_S, deserializes it as grpc would have (a large inference request with
its tensors lifted out: service.grpc.wire.split), and hands it to the servicer's method. gRPC shows no
part of a message before the whole of it, so there is no rate to check as HTTP does: the whole message
must be in by then.

    calls under way       at most ATTEND_MAX_CONNECTIONS (ServerLive, ServerReady and grpc.health.v1's
                          Check and List exempt, as HTTP's health probes): UNAVAILABLE with retry-after 1,
                          attend_refused{reason="connections"}
    a message not in      within ATTEND_BODY_TIMEOUT_S: DEADLINE_EXCEEDED (HTTP's 408),
                          attend_refused{reason="body_timeout"}
    a message too large   over ATTEND_MAX_BODY_BYTES: RESOURCE_EXHAUSTED (grpc's own check, as it arrives);
                          a control call's (every method but ModelInfer and ModelStreamInfer) over 64 KiB
    a costly parse        over MAX_FIELDS fields, or packed integers over ATTEND_MAX_BODY_BYTES parsed:
                          refused before protobuf parses it (service.grpc.wire)
    connections           ATTEND_MAX_OPEN_CONNECTIONS (grpc.max_allowed_incoming_connections: closed at accept)
    calls not yet taken   ATTEND_MAX_OPEN_CONNECTIONS, then grpc drops calls at random until twice that
                          (CANCELLED, grpc's own early drop): a flood past what the event loop takes

ModelStreamInfer, Triton's stream of inference calls, is a connection of its own kind: it stays open for as
long as the client keeps it (as a gRPC connection does), and at most ATTEND_MAX_OPEN_CONNECTIONS are open at
once. Each of its messages is a call, counted against ATTEND_MAX_CONNECTIONS while it is served. A message
is awaited for as long as the stream is open: gRPC cannot tell a stream between messages from one whose
message stalled, and a stalled one holds what it sent. At SIGTERM a stream takes no more messages: what is
under way is answered, then the stream ends UNAVAILABLE. grpc.health.v1's Watch (one message in, statuses
out) is a stream too, counted with them; at SIGTERM it says NOT_SERVING, then ends the same way.

A connection's streams are not limited apart (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS): a client that opened
more before the setting reached it had them reset, an UNAVAILABLE that said nothing of why; past the calls'
bound each gets the message above at once, and its stream is closed. As with HTTP's connection guard, a
client may hold ATTEND_MAX_CONNECTIONS calls with messages that never come for ATTEND_BODY_TIMEOUT_S each;
then they are ended, and the memory a stalled call holds is what it sent (grpc's flow control).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.core.errors import (
    CONTROL_BODY_BYTES,
    InvalidRequest,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
)
from service.core.logs import log_access
from service.grpc import wire
from service.grpc.status import end_call

HEALTH = frozenset({"ServerLive", "ServerReady", "Check", "List"})  # Triton's probes, and grpc.health.v1's
INFERENCE = frozenset({"ModelInfer", "ModelStreamInfer"})  # the methods whose messages hold tensors
# The bytes of the call's message parsed (the handler's task's; service.grpc.wire): what ModelInfer holds
# against the in-flight budget. Kept, because protobuf's ByteSize() would walk a message of tensors again.
message_size: contextvars.ContextVar[int] = contextvars.ContextVar("message_size", default=0)


def options(max_body_bytes: int, max_open_connections: int, shared_port: bool, handshake_s: float
            ) -> list[tuple[str, int]]:
    """grpc's server options for the limits above."""
    return [
        # A connection's handshake (TLS, then HTTP/2's settings) within ATTEND_HEADER_TIMEOUT_S, not grpc's 120 s.
        ("grpc.server_handshake_timeout_ms", max(1, int(handshake_s * 1000))),
        ("grpc.max_receive_message_length", max_body_bytes),
        ("grpc.max_send_message_length", -1),  # the answers' size is bounded by the request limits
        ("grpc.max_allowed_incoming_connections", max_open_connections),
        # Calls come in faster than the event loop takes them: past 1000 waiting (grpc's default), grpc drops
        # some at random, CANCELLED with no word of why; the guard answers them instead, at once.
        ("grpc.server.max_pending_requests", max_open_connections),
        ("grpc.server.max_pending_requests_hard_limit", 2 * max_open_connections),
        ("grpc.so_reuseport", int(shared_port)),
    ]


class Handlers:
    """Stands in for the server in the generated `add_GRPCInferenceServiceServicer_to_server`: takes the
    method handlers it would register, so that they can be registered guarded."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers as below, looked up by name

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


class MessageCheck:
    """What a method's message may cost before protobuf parses it: a control call's at most 64 KiB, and a
    large one walked first (service.grpc.wire)."""

    def __init__(self, max_message_bytes: int, setting: str = "ATTEND_MAX_BODY_BYTES"):
        self.max_message_bytes = max_message_bytes
        self.setting = setting  # the limit's name, in the refusal
        self.schemas: dict[str, dict[int, Any]] = {}  # each method's request message, by name
        self.lifts: dict[str, frozenset[str]] = {}  # an inference method's: the paths its tensors are lifted from

    def add(self, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            descriptor = handler.request_deserializer.__self__.DESCRIPTOR
            self.schemas[name] = wire.schema(descriptor)
            if name in INFERENCE:
                self.lifts[name] = wire.LIFTED

    def read(self, name: str, message: bytes, deserialize: Callable[[bytes], Any]) -> tuple[Any, int]:
        """`message` parsed (an inference method's as wire.Received, its tensors lifted out where it is large),
        and the bytes it takes; raises as parsed_bytes."""
        lift = self.lifts.get(name)
        if lift is None or len(message) <= wire.SCAN_BYTES:
            size = self.parsed_bytes(name, message)
            request = deserialize(message)
            return (request if lift is None else wire.Received(request)), size
        size, rest, raw, typed = wire.split(message, self.schemas[name], self.max_message_bytes, self.setting, lift)
        return wire.Received(deserialize(rest), raw or None, typed or None), size

    def parsed_bytes(self, name: str, message: bytes) -> int:
        """The bytes `message` takes parsed; raises ServiceError where it may not be parsed, DecodeError where
        it is not a message."""
        if name not in INFERENCE and len(message) > CONTROL_BODY_BYTES:
            raise PayloadTooLarge(f"{name}'s message has {len(message)} bytes; the limit is {CONTROL_BODY_BYTES} "
                                  "(a control call's limit)", expected=CONTROL_BODY_BYTES, received=len(message))
        if len(message) <= wire.SCAN_BYTES:
            return len(message)
        return wire.parsed_bytes(message, self.schemas[name], self.max_message_bytes, self.setting)


def service_check(max_message_bytes: int) -> MessageCheck:
    """A MessageCheck of the service's own methods, outside a server (bench/grpc_read.py, tests/load/membound.py)."""
    from service.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    taken = Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(pb_grpc.GRPCInferenceServiceServicer(), taken)
    check = MessageCheck(max_message_bytes)
    check.add(taken.handlers)
    return check


def _serialize(message: Any) -> bytes:
    """A method's answer: a message, or one serialized already where the answer was encoded (codec.Wire)."""
    return message.SerializeToString()


def not_a_message(name: str) -> InvalidRequest:
    return InvalidRequest(f"{name}: the request message is not an inference.{name}Request")


class CallGuard:
    """Counts the calls under way and reads each one's message within the time allowed."""

    def __init__(self, max_calls: int, message_timeout_s: float, refusals: Mapping[str, Any],
                 gone: Callable[[str, float], None] = lambda name, seconds: None, max_streams: int = 4096,
                 max_message_bytes: int = 1 << 62):
        self.max_calls = max_calls
        self.check = MessageCheck(max_message_bytes)  # the methods', as they are registered
        self.message_timeout_s = message_timeout_s
        self.refusals = refusals
        self.gone = gone  # a call whose client went away while its message came: (method, seconds)
        self.max_streams = max_streams
        self.calls = 0
        self.streams = 0
        self.unfinished = 0  # the calls taken in whose answer grpc has not yet handed to its transport
        self.stopping = False  # SIGTERM (service.grpc.drain): every call but the probes refused
        self._stopped = asyncio.Event()  # the same, for the streams waiting for a message

    def stop(self) -> None:
        """SIGTERM: refuse every new call but the probes, and end the streams once their calls are answered."""
        self.stopping = True
        self._stopped.set()

    async def stopped(self) -> None:
        """Returns at SIGTERM."""
        await self._stopped.wait()

    def take(self) -> ServiceError | None:
        """A call begins: counted, or the reason it may not (`give` it back once it is answered)."""
        if self.stopping:
            return _stopping("retry on another")
        if self.calls >= self.max_calls:
            self._refused("connections")
            return Overloaded(f"{self.max_calls} calls are under way (ATTEND_MAX_CONNECTIONS); retry shortly",
                              headers={"Retry-After": "1"})
        self.calls += 1
        return None

    def give(self) -> None:
        self.calls -= 1

    def register(self, server: grpc.aio.Server, add_servicer: Callable[[Any, Any], None], servicer: Any) -> None:
        taken = Handlers()
        add_servicer(servicer, taken)
        self.check.add(taken.handlers)
        guarded = {name: self.guarded(name, handler) for name, handler in taken.handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(taken.service, guarded),))
        server.add_registered_method_handlers(taken.service, guarded)

    def guarded(self, name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.request_streaming:
            return self.guarded_stream(name, handler)
        if handler.response_streaming:
            return self.guarded_watch(name, handler)
        behavior, deserialize = handler.unary_unary, handler.request_deserializer
        exempt = name in HEALTH

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            if exempt:
                self.calls += 1
            else:
                refusal = self.take()
                if refusal is not None:
                    return refuse(context, name, refusal)
            self.unfinished += 1
            context.add_done_callback(self._finished)  # once grpc has sent the answer and the status
            try:
                request = await self._message(name, context, deserialize)
                return None if request is None else await behavior(request, context)
            finally:
                self.calls -= 1

        call.__name__ = name
        return grpc.stream_unary_rpc_method_handler(call, request_deserializer=None,
                                                    response_serializer=_serialize)

    async def _message(self, name: str, context: grpc.aio.ServicerContext, deserialize: Callable[[bytes], Any]
                       ) -> Any:
        """A call's one message, read within ATTEND_BODY_TIMEOUT_S; None where the call was ended instead."""
        started = time.perf_counter()
        try:
            message = await asyncio.wait_for(context.read(), self.message_timeout_s)
        except asyncio.CancelledError:
            self.gone(name, time.perf_counter() - started)
            raise
        except TimeoutError:
            self._refused("body_timeout")
            return refuse(context, name, RequestTimeout(
                f"the call's message did not arrive within {self.message_timeout_s:g} s (ATTEND_BODY_TIMEOUT_S)"))
        if message is grpc.aio.EOF:
            return refuse(context, name, InvalidRequest(f"{name}: the call ended before its request message"))
        try:
            request, size = self.check.read(name, message, deserialize)
        except DecodeError:
            return refuse(context, name, not_a_message(name))
        except ServiceError as e:
            return refuse(context, name, e)
        message_size.set(size)
        return request

    def _open_stream(self, name: str, context: grpc.aio.ServicerContext) -> bool:
        """A stream opens: counted against ATTEND_MAX_OPEN_CONNECTIONS (`streams`, given back by the caller),
        or refused."""
        if self.stopping:
            refuse(context, name, _stopping("retry on another"))
            return False
        if self.streams >= self.max_streams:
            self._refused("connections")
            refuse(context, name, Overloaded(
                f"{self.max_streams} streams are open (ATTEND_MAX_OPEN_CONNECTIONS); retry shortly",
                headers={"Retry-After": "1"}))
            return False
        self.streams += 1
        self.unfinished += 1
        context.add_done_callback(self._finished)
        return True

    def guarded_watch(self, name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """One message in, a stream of answers out, for as long as the client keeps it (grpc.health.v1's
        Watch): a stream, open while it lasts; its message read as a call's."""
        behavior, deserialize = handler.unary_stream, handler.request_deserializer

        async def serve(context: grpc.aio.ServicerContext) -> bool:
            request = await self._message(name, context, deserialize)
            if request is None:  # ended already, with the reason
                return False
            async for answer in behavior(request, context):
                await context.write(answer)
            return True

        return self._stream_handler(name, handler, serve, "watch another replica")

    def guarded_stream(self, name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A stream of calls (ModelStreamInfer): the servicer's method gets its messages as (request, size),
        each counted as a call already (it gives it back), or as (the reason it was refused, size)."""
        behavior, deserialize = handler.stream_stream, handler.request_deserializer

        async def serve(context: grpc.aio.ServicerContext) -> bool:
            await behavior(self._messages(name, context, deserialize), context)
            return True

        return self._stream_handler(name, handler, serve, "open the stream again on another")

    def _stream_handler(self, name: str, handler: grpc.RpcMethodHandler,
                        serve: Callable[[grpc.aio.ServicerContext], Awaitable[bool]], advice: str
                        ) -> grpc.RpcMethodHandler:
        """A stream, counted while `serve` runs; served through SIGTERM, it then ends UNAVAILABLE with `advice`."""

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> None:
            if not self._open_stream(name, context):
                return
            try:
                if await serve(context) and self.stopping:
                    refuse(context, name, _stopping(advice))
            finally:
                self.streams -= 1

        call.__name__ = name
        return grpc.stream_stream_rpc_method_handler(call, request_deserializer=None,
                                                     response_serializer=_serialize)

    async def _messages(self, name: str, context: grpc.aio.ServicerContext, deserialize: Callable[[bytes], Any]
                        ) -> AsyncIterator[tuple[Any, int]]:
        """A stream's messages, until the client half-closes it or the service stops."""
        stopped = asyncio.ensure_future(self._stopped.wait())
        read: asyncio.Future | None = None
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait((read, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    return
                message = read.result()
                if message is grpc.aio.EOF:
                    return
                refusal = self.take()
                if refusal is not None:
                    yield refusal, len(message)
                    continue
                size = len(message)
                try:
                    request, size = self.check.read(name, message, deserialize)
                except DecodeError:
                    self.give()
                    request = InvalidRequest(f"{name}: a message is not an inference.ModelInferRequest")
                except ServiceError as e:
                    self.give()
                    request = e
                yield request, size
        finally:  # the service stops, or the call was cancelled: the read ends with it
            stopped.cancel()
            if read is not None:
                read.cancel()

    def _finished(self, context: grpc.aio.ServicerContext) -> None:
        self.unfinished -= 1

    def _refused(self, reason: str) -> None:
        counter = self.refusals.get(reason)
        if counter is not None:
            counter.inc()


def _stopping(advice: str) -> NotReady:
    return NotReady(f"the service is stopping; {advice}", headers={"Retry-After": "1"})


def refuse(context: grpc.aio.ServicerContext, name: str, error: ServiceError) -> None:
    """Ends call `name` with `error`, and writes its access line."""
    log_access("GRPC", name, error.status, 0.0)
    end_call(context, error)
