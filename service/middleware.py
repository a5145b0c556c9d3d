"""Request IDs and the access log, as one pure ASGI middleware (no BaseHTTPMiddleware: it
would buffer bodies and cost a task per request).

`X-Request-ID` is taken from the request when it is a sane token, made up otherwise, returned
on the response and attached to every log record of the request (`%(request_id)s`). Made-up IDs
are this process's random prefix and a counter: unique, and without a uuid4 (a system call) a request.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_SANE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
access = logging.getLogger("service.access")
_PREFIX = os.urandom(4).hex() + "-"  # made-up request IDs: this process's prefix, then a counter
_COUNTER = itertools.count(1)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def configure_logging(level: str) -> None:
    """One format for every line, the request ID in each. uvicorn logs through it too (it is given
    log_config=None); its start-up chatter only at debug. Worker processes call this again."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if level != "debug":
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


class RequestContext:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if incoming is not None and _SANE.match(incoming.decode("latin-1")):
            rid, rid_bytes = incoming.decode("latin-1"), incoming
        else:
            rid = f"{_PREFIX}{next(_COUNTER):x}"
            rid_bytes = rid.encode()
        token = request_id.set(rid)
        start = time.perf_counter()
        status = 0  # no response: the client went away first

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid_bytes)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if access.isEnabledFor(logging.INFO):
                access.info("%s %s %d %.1fms", scope["method"], scope["path"], status or 499,
                            1e3 * (time.perf_counter() - start))
            request_id.reset(token)
