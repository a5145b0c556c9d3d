"""Logging: one format for every line, request IDs, and the access log line.

`X-Request-ID` is taken from the request when it is a sane token, made up otherwise, returned
on the response and attached to every log record of the request (`%(request_id)s`); while tracing is
on, the request's trace and span ids end its lines. Made-up IDs
are this process's random prefix and a counter: unique, and without a uuid4 (a system call) a request.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import re
import threading
import time
from collections import deque
from typing import Any

from service.core.errors import ServiceError

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# "trace_id=... span_id=..." of the request being served, while tracing is on (service.core.tracing): at the end
# of its log lines, so that a line leads to its trace.
trace_ids: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_ids", default=None)
_SANE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
access = logging.getLogger("service.access")
_PREFIX = os.urandom(4).hex() + "-"  # made-up request IDs: this process's prefix, then a counter
_COUNTER = itertools.count(1)


def escape(text: str) -> str:
    """`text` with every character that is not printable written as its escape (a line break as \\n, an
    ANSI escape as \\x1b): what a client sent (a path, a model's name, a header) cannot start a line of
    its own in the log, or colour a terminal."""
    if text.isprintable():  # nearly always: one C call
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.trace_ids = trace_ids.get()
        return True


# Log lines are formatted when they happen and written in batches, at most this long after: an
# access log line a request would otherwise cost a write() system call each (measured with strace).
LOG_FLUSH_S = 0.2


class _Formatter(logging.Formatter):
    """The service's format, built directly (logging's generic %-style formatting costs several
    microseconds a line), with the date and time part computed once a second."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return self._time(record.created, int(record.msecs))

    def _time(self, created: float, msecs: int) -> str:
        second = int(created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second))
        return f"{self._stamp},{msecs:03d}"

    def access_line(self, message: str) -> str:
        """What `format` makes of an INFO record of service.access logged now, made without the
        record (making and handling one is most of what a log_access would cost)."""
        now = time.time()
        return (f"{self._time(now, int((now - int(now)) * 1000))} INFO service.access [{request_id.get()}] "
                f"{escape(message)}\n")

    def format(self, record: logging.LogRecord) -> str:
        line = (f"{self.formatTime(record)} {record.levelname} {record.name} "
                f"[{getattr(record, 'request_id', '-')}] {escape(record.getMessage())}")
        ids = getattr(record, "trace_ids", None)
        if ids is not None:
            line = f"{line} {ids}"
        if record.exc_info or record.exc_text or record.stack_info:  # the traceback on lines of its own
            if record.exc_info and not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
            parts = [line, record.exc_text or "", self.formatStack(record.stack_info) if record.stack_info else ""]
            return "\n".join(part for part in parts if part)
        return line


class _BatchHandler(logging.StreamHandler):
    """Formats each record as it comes (in the thread that logs it: formatting a whole batch later,
    in another thread, took the event loop's core for milliseconds and doubled the p99 latency) and
    writes the lines in one write(), in the flusher's thread: every LOG_FLUSH_S, at once for a WARNING or
    worse, and by flush_logs() before the process exits. The thread that logs never writes, nor waits
    for the one that does: stderr may be a pipe that a log driver drains late."""

    def __init__(self) -> None:
        super().__init__()
        # A deque: its append (a request's thread) and popleft (the flusher's) are thread-safe, without a
        # lock the event loop would wait on while the flusher writes. (A list swapped for a new one lost a
        # line now and then: appended to the old one after the swap, written no more.)
        self.lines: deque[str] = deque()
        self.urgent = threading.Event()  # a WARNING or worse: the flusher writes at once

    def handle(self, record: logging.LogRecord) -> Any:
        """logging.Handler.handle without the handler's lock around emit: that lock is the writer's
        (flush), held for as long as a write to a full pipe waits."""
        kept = self.filter(record)
        if kept:
            self.emit(kept if isinstance(kept, logging.LogRecord) else record)
        return kept

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self.lines.append(line)
        if record.levelno >= logging.WARNING:
            self.urgent.set()

    def flush(self) -> None:
        with self.lock:
            queued = self.lines
            lines = [queued.popleft() for _ in range(len(queued))]
            if lines:
                try:
                    self.stream.write("".join(lines))
                    self.stream.flush()
                except Exception:
                    pass  # stderr is gone: nothing else to tell it to


class _Flusher(threading.Thread):
    def __init__(self, handler: _BatchHandler):
        super().__init__(name="log-flush", daemon=True)
        self.handler = handler

    def run(self) -> None:
        while True:
            handler = self.handler
            if handler.urgent.wait(LOG_FLUSH_S):
                handler.urgent.clear()
            if handler.lines:
                handler.flush()


def configure_logging(level: str) -> None:
    """One format for every line, the request ID in each. uvicorn logs through it too (it is given
    log_config=None); its start-up chatter only at debug. Worker processes call this again."""
    # What the format does not show, records need not look up: the process (getpid, a system call,
    # three times a record, measured with strace), the thread, the caller's file and line.
    logging.logProcesses = logging.logMultiprocessing = logging.logThreads = False
    logging._srcfile = None  # the documented way to skip findCaller (logging's "Optimization" notes)
    global _handler
    handler = _handler = _BatchHandler()
    handler.setFormatter(_Formatter())
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    _Flusher(handler).start()
    if level != "debug":
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


def flush_logs() -> None:
    """Write what the handlers hold (before the process exits by a signal, which skips atexit)."""
    for handler in logging.getLogger().handlers:
        handler.flush()


def new_request_id(incoming: bytes | None) -> tuple[str, bytes]:
    """The request's ID, as text and as a header value: the client's when it is a sane token."""
    if incoming is not None:
        text = incoming.decode("latin-1")
        if _SANE.match(text):
            return text, incoming
    text = f"{_PREFIX}{next(_COUNTER):x}"
    return text, text.encode()


_handler: _BatchHandler | None = None  # configure_logging's


def _only_handler() -> _BatchHandler | None:
    """configure_logging's handler, when it is the only place an access log record would go (with
    its own filter only, no other handler or filter on the way): then `log_access` can hand it the
    line directly. Not, for instance, under pytest's caplog, or after another logging setup."""
    handler = _handler
    if handler is None or handler.level > logging.INFO or len(handler.filters) != 1 or access.filters:
        return None
    logger: Any = access
    while logger.parent is not None:
        if logger.handlers or not logger.propagate:
            return None
        logger = logger.parent
    handlers = logger.handlers
    return handler if len(handlers) == 1 and handlers[0] is handler else None


def log_access(method: str, path: str, status: int, seconds: float, ids: str | None = None) -> None:
    """The access line; `ids`: the request's trace and span ids (tracing on), at its end."""
    if access.isEnabledFor(logging.INFO):
        handler = _only_handler()
        if handler is not None:  # the same line as the record's, without the record
            handler.lines.append(handler.formatter.access_line(  # type: ignore[union-attr]
                f"{method} {path} {status or 499} {1e3 * seconds:.1f}ms" if ids is None else
                f"{method} {path} {status or 499} {1e3 * seconds:.1f}ms {ids}"))
        else:  # the record's ids come from the request's context (RequestIdFilter)
            access.info("%s %s %d %.1fms", method, path, status or 499, 1e3 * seconds)




# ------------------------------------------------------------------------- Triton's logging extension


class InvalidLogSettings(ServiceError):
    """A log setting that is not one of Triton's, or a value it cannot take (GET /v2/logging lists them)."""

    status, code = 400, "invalid_log_settings"
    advice = ("Send some of log_info, log_warning, log_error (true or false) and log_verbose_level (0, or more for "
              "debug lines); log_file is \"\" and log_format \"default\": the service logs to its standard error.")


_SETTINGS: dict[str, type] = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool,
                              "log_verbose_level": int, "log_format": str}


def log_settings() -> dict[str, Any]:
    """Triton's log settings, as the root logger's level has them (debug: a verbose level of 1)."""
    level = logging.getLogger().level
    return {"log_file": "", "log_info": level <= logging.INFO, "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR, "log_verbose_level": int(level <= logging.DEBUG),
            "log_format": "default"}


def changed_log_settings(changes: dict[str, Any]) -> dict[str, Any]:
    """The settings after `changes` (a subset of log_settings'), checked (InvalidLogSettings), not applied."""
    settings = log_settings()
    for name, value in changes.items():
        kind = _SETTINGS.get(name)
        if kind is None:
            raise InvalidLogSettings(f"{escape(str(name))[:100]} is not a log setting; they are "
                                     f"{', '.join(_SETTINGS)}", field=name[:100])
        if value.__class__ is not kind or (kind is int and value < 0):
            shown = {bool: "true or false", int: "a non-negative integer", str: "a string"}[kind]
            raise InvalidLogSettings(f"{name} must be {shown}", field=name)
        settings[name] = value
    if settings["log_file"]:
        raise InvalidLogSettings("log_file must be \"\": the service logs to its standard error, never to a file "
                                 "a request names", field="log_file")
    if settings["log_format"] != "default":
        raise InvalidLogSettings("log_format must be \"default\", the service's one format", field="log_format")
    return settings


def apply_log_settings(settings: dict[str, Any]) -> None:
    """The level `settings` say: debug where the verbose level is above 0, else the least severe of info,
    warning and error that is on (critical where none is)."""
    level = (logging.DEBUG if settings["log_verbose_level"] else logging.INFO if settings["log_info"] else
             logging.WARNING if settings["log_warning"] else logging.ERROR if settings["log_error"] else
             logging.CRITICAL)
    logging.getLogger().setLevel(level)
    logging.getLogger("uvicorn.error").setLevel(logging.NOTSET if level == logging.DEBUG else logging.WARNING)
