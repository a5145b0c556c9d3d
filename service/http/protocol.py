"""uvicorn's HTTP protocol, as the service runs it: guarded against hostile clients.

`GuardedProtocol` is uvicorn's httptools protocol with what a hostile client would otherwise get
away with taken away (each limit an ATTEND_* setting, see service/config.py):

- headers must be complete within `header_timeout_s` of the connection (or of the previous
  response), and within `max_header_bytes` in all: past either, the connection gets a 408 or a
  431 and is closed; header bytes are never buffered past the limit;
- a body must keep coming: a connection whose body has not progressed for `body_timeout_s`, or whose
  average rate is under `min_body_rate` bytes/s after that long, gets a 408 and is closed;
- requests in progress (not health probes) are bounded by `max_connections`, open connections by
  `max_open_connections` (beyond: refused at once). Health probes are never refused for load, so an
  orchestrator does not restart a busy service. (What requests cost in memory is the core's budget:
  service.core.cost.)
- a response sent before the request's body is all in (a refusal: 413, 503, 401, ...) is followed by
  a drain: the rest of the body is read and dropped, at most `drain_bytes` and `drain_s`, so that a
  client that sends its whole body before reading reads the answer, instead of a reset (nginx's
  lingering close); a connection to be closed is half-closed (FIN) meanwhile.

Every refusal carries the error body of the path's protocol (and Retry-After for overload), and is
counted by its reason in attend_refused_total (service.core.metrics.REFUSALS), on the refusal's path
only.

It also offers the inference endpoints extensions of the ASGI scope (service.http.extensions lists them),
among them "attend.hold" (a response's head and body, or its parts, in one write) and "attend.body" (a body
with a Content-Length written once into one aligned buffer as it arrives), both service.http.transport's.

The graceful server and its workers are service.http.server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.core.errors import HeadersTooLarge, Overloaded, RequestTimeout, ServiceError
from service.http.endpoint import error_body
from service.http.guard import guard
from service.http.transport import BodySink, CoalescingTransport

log = logging.getLogger("service")
HEALTH = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})
_HEALTH_BYTES = frozenset(p.encode() for p in HEALTH)


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def _refusal(error: ServiceError, path: bytes) -> bytes:
    """A complete HTTP response for a refusal made before (or instead of) the app: the error in the body
    of the path's protocol (service.http.endpoint.error_body), and the connection closed."""
    body = error_body(path.decode("latin-1"), error)
    head = [b"HTTP/1.1 %d %s" % (error.status, _REASONS[error.status]), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    head += [b"%s: %s" % (k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _disconnected(cycle_ref: weakref.ref) -> bool:
    """The "attend.disconnected" extension: whether the client of the request has gone."""
    cycle = cycle_ref()
    return cycle is None or cycle.disconnected


def _overloaded(message: str) -> Overloaded:
    return Overloaded(message, headers={"Retry-After": "1"})


class GuardedProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # The served app's settings, where GracefulServer put its guard on the config (every worker
        # makes its own); else the environment's.
        self.guard = getattr(self.config, "attend_guard", None) or guard()
        self._awaiting_headers = False
        self._header_bytes = 0
        self._headers_due = 0.0  # when the headers awaited must have come (loop time)
        self._body_check = 0.0  # when the body being received is next checked (0: none is)
        self._body_expected = False  # the request being parsed has a body (Content-Length or chunked)
        self._draining = False  # the rest of a refused request's body is being read and dropped
        self._drain_left = 0  # bytes it may still take
        self._drain_until = 0.0  # and until when (loop time)
        self._close_after_drain = False
        self._body_bytes = 0
        self._body_started = 0.0
        self._body_progress = (0.0, 0)  # (time, bytes) of the last progress
        self._body_length = 0  # the Content-Length of the request being parsed (0: none, or chunked)
        self._sink: BodySink | None = None  # where its body goes, once the app has claimed it

    # --- connections and headers

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescingTransport(transport, self._closing)  # type: ignore[assignment]
        if len(self.connections) > self.guard.settings.max_open_connections:
            self.guard.refused("open_connections")
            self._refuse(_overloaded("too many open connections; retry shortly"), drain=True)
            return
        self.guard.add(self)
        self._expect_headers()

    def _expect_headers(self) -> None:
        self._awaiting_headers = True
        self._header_bytes = 0
        self._headers_due = self.loop.time() + self.guard.settings.header_timeout_s

    def check_deadlines(self, now: float) -> None:
        """The guard's sweep: headers late, a body to check, a drain over."""
        if self._awaiting_headers and now >= self._headers_due:
            self._headers_too_slow()
        elif self._body_check and now >= self._body_check:
            self._check_body(now)
        elif self._draining and now >= self._drain_until:
            self._draining = False
            self.guard.refused("drain_closed")
            self.transport.close(now=True)  # type: ignore[call-arg]

    def _headers_too_slow(self) -> None:
        self._awaiting_headers = False
        if not self.transport.is_closing():
            # An idle keep-alive connection just closes; one that began a request gets a 408.
            if self._header_bytes:
                self.guard.refused("header_timeout")
                self._refuse(RequestTimeout(f"the request's headers did not arrive within "
                                            f"{self.guard.settings.header_timeout_s:g} s (ATTEND_HEADER_TIMEOUT_S)"))
            else:
                self.transport.close()

    def _refuse(self, error: ServiceError, drain: bool = False) -> None:
        """Answer `error` (unless a response began) and close the connection; with `drain`, after
        reading and dropping what the client is still sending of its request (bounded)."""
        self._awaiting_headers = False
        self._body_check = 0.0
        if not self.transport.is_closing():
            cycle = self.cycle  # the request's, or (before its headers are in) the previous one's
            if cycle is None or cycle.response_complete or not cycle.response_started:
                self.transport.write(_refusal(error, getattr(self, "url", None) or b""))
            if drain and self._start_drain(close=True):
                return
            self.transport.close(now=True)  # type: ignore[call-arg]

    # --- the drain

    def _start_drain(self, close: bool) -> bool:
        """Read and drop the rest of the request (its body) before going on: False where the settings
        allow no drain. A connection to be closed is half-closed first: the client, done sending,
        reads the answer and the end of it."""
        settings = self.guard.settings
        if not (settings.drain_bytes and settings.drain_s):
            return False
        self._draining = True
        self._close_after_drain = close
        self._drain_left = settings.drain_bytes
        self._drain_until = self.loop.time() + settings.drain_s
        self._awaiting_headers = False
        self._body_check = 0.0
        self._sink = None
        if close:
            self.transport.write_eof()
        self.flow.resume_reading()
        return True

    def _drained(self) -> None:
        self._draining = False
        if self._close_after_drain:
            self.transport.close(now=True)  # type: ignore[call-arg]
        elif not self.transport.is_closing():
            self._expect_headers()

    def _closing(self) -> bool:
        """The transport is asked to close (a response with Connection: close, or uvicorn's keep-alive
        timer): True defers it to a drain, where the request's body is not all in."""
        if self._draining:
            return True  # the drain closes it
        cycle = self.cycle
        if cycle is None or not cycle.response_complete or not cycle.more_body or cycle.disconnected:
            return False
        return self._start_drain(close=True)

    def data_received(self, data: bytes) -> None:
        if self._draining:
            self._drain_left -= len(data)
            try:
                if self._drain_left >= 0:
                    self.parser.feed_data(data)  # finds where the request ends (its body is dropped)
                    return
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                pass  # not HTTP: no answer to wait for
            self._draining = False
            self.guard.refused("drain_closed")
            self.transport.close(now=True)  # type: ignore[call-arg]
            return
        if self._awaiting_headers:
            self._header_bytes += len(data)
            super().data_received(data)
            # Still in the headers after this chunk, and past the limit: refuse before the parser
            # holds more of them (what it holds is at most the limit plus one read).
            if self._awaiting_headers and self._header_bytes > self.guard.settings.max_header_bytes:
                self.guard.refused("header_size")
                self._refuse(HeadersTooLarge(f"the request's headers are over "
                                             f"{self.guard.settings.max_header_bytes} bytes (ATTEND_MAX_HEADER_BYTES)"))
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._awaiting_headers:  # a pipelined request: its headers count from here
            self._expect_headers()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        if self._draining:  # a request on a connection refused already: dropped like its body
            return
        refusal = self._admission()
        if refusal is None:
            super().on_headers_complete()
            # When the request arrived, for its deadline: under load its task may start much later.
            extensions = self.scope.setdefault("extensions", {})
            extensions["attend.arrived"] = arrived = time.monotonic()
            self.guard.busy.touch(id(self), arrived)  # its id: a closed connection is not kept alive
            extensions["attend.hold"] = self.transport.hold_next  # type: ignore[attr-defined]
            # The cycle by a weak reference: its scope holds these, and a strong one would make each
            # request a reference cycle, left to the garbage collector (what that costs: `python
            # bench/gc_cost.py`).
            cycle = weakref.ref(self.cycle)
            # Whether the client has gone (uvicorn marks the cycle at connection_lost): read by the
            # batching for requests that have waited.
            extensions["attend.disconnected"] = functools.partial(_disconnected, cycle)
            if self._body_length:
                extensions["attend.body"] = functools.partial(self._claim_body, cycle, self._body_length)
            if self._body_expected and self.cycle is not None:
                self._body_started = self.loop.time()
                self._body_progress = (self._body_started, 0)
                self._body_bytes = 0
                self._body_check = self._body_started + self.guard.settings.body_timeout_s
            return
        # Answered here, instead of by the service (no task, no cycle): the body is drained, not read.
        self.guard.refused("connections")
        self._refuse(_overloaded(refusal), drain=self._body_expected)

    def _admission(self) -> str | None:
        """Why the request just parsed is refused for load (None: it is not); a body it is admitted
        with is counted against the in-flight budget."""
        length = None
        self._body_expected = False
        self._body_length = 0
        for key, value in self.headers:
            if key == b"content-length":
                length = value
                self._body_expected = value != b"0"
            elif key == b"transfer-encoding":
                self._body_expected = True
        if self.url.partition(b"?")[0] in _HEALTH_BYTES:
            return None  # health probes: never refused for load
        settings = self.guard.settings
        if len(self.tasks) >= settings.max_connections:
            return f"{settings.max_connections} requests are in progress (ATTEND_MAX_CONNECTIONS); retry shortly"
        size = int(length) if length is not None and length.isdigit() else 0
        self._body_length = size if size <= settings.max_body_bytes else 0  # larger: 413 from the app, unread
        return None

    # --- bodies

    def _claim_body(self, cycle_ref: weakref.ref, size: int, aligned_at: int = 0) -> asyncio.Future:
        """The "attend.body" extension: the whole body of `cycle_ref`'s request (Content-Length `size`)
        in one buffer (BodySink), the byte at `aligned_at` 64-byte aligned; None if the client goes
        away first. Instead of `receive()`, not beside it."""
        done = self.loop.create_future()
        cycle = cycle_ref()
        if cycle is None:  # (not while its request's task runs: the task holds it)
            done.set_result(None)
            return done
        sink = BodySink(size, aligned_at, done)
        sink.write(cycle.body)  # what came before the claim (uvicorn's way)
        cycle.body = bytearray()
        if cycle.disconnected:
            done.set_result(None)
        elif not cycle.more_body:  # complete already
            sink.finish()
        else:
            if cycle.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                cycle.waiting_for_100_continue = False
            self._sink = sink
            self.flow.resume_reading()
        return done

    def on_body(self, body: bytes) -> None:
        if self._draining:
            return  # dropped (counted in data_received)
        self._body_bytes += len(body)
        sink = self._sink
        if sink is not None:
            if not sink.done.done():
                sink.write(body)
                return
            self._sink = None  # the app gave up waiting (its deadline): uvicorn's way for the rest
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_check = 0.0
        if self._draining:
            self._drained()
            return
        if self._sink is not None:
            self._sink.finish()
            self._sink = None
        super().on_message_complete()

    def _check_body(self, now: float) -> None:
        """A body that stalls, or comes slower than the minimum rate, closes its connection. Time
        the service itself holds the body back (flow control, while the app is busy) does not count."""
        self._body_check = 0.0
        if self.transport.is_closing() or self.cycle is None or not self.cycle.more_body:
            return
        settings = self.guard.settings
        last_time, last_bytes = self._body_progress
        if self.flow.read_paused:
            self._body_progress = (now, self._body_bytes)
        elif self._body_bytes == last_bytes and now - last_time >= settings.body_timeout_s:
            return self._body_too_slow("body_timeout", f"no byte of the body for {settings.body_timeout_s:g} s "
                                       "(ATTEND_BODY_TIMEOUT_S)")
        elif (self._body_bytes / (now - self._body_started) < settings.min_body_rate
              and now - self._body_started >= settings.body_timeout_s):
            return self._body_too_slow("body_rate", f"the body comes at under {settings.min_body_rate} bytes/s "
                                       "(ATTEND_MIN_BODY_RATE)")
        if self._body_bytes != last_bytes:
            self._body_progress = (now, self._body_bytes)
        self._body_check = now + 1.0

    def _body_too_slow(self, reason: str, why: str) -> None:
        log.info("closing a connection: %s", why)
        self.guard.refused(reason)
        if self.cycle is not None and not self.cycle.response_started:
            self.transport.write(_refusal(RequestTimeout(why), self.url or b""))
        self.transport.close(now=True)  # type: ignore[call-arg]

    def on_response_complete(self) -> None:
        # A pipelined request whose headers are in already starts now (uvicorn's pipeline): what
        # comes next is its body, not headers to time and count.
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self._draining or self.transport.is_closing():
            return
        cycle = self.cycle  # the answered request's, or a pipelined one's that starts now
        if cycle is not None and cycle.response_complete and cycle.more_body and not cycle.disconnected \
                and self._start_drain(close=False):
            return  # answered before its body was all in (a refusal): the rest is dropped, then the next request
        if not pipelined:
            self._expect_headers()

    def shutdown(self) -> None:
        if self._draining:  # the server stops: no more waiting for a refused client's body
            self._draining = False
            self.transport.close(now=True)  # type: ignore[call-arg]
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._draining = False
        self._awaiting_headers = False
        self._body_check = 0.0
        self.guard.remove(self)
        if self._sink is not None and not self._sink.done.done():
            self._sink.done.set_result(None)
        self._sink = None
        super().connection_lost(exc)


