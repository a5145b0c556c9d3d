"""The contract between a protocol's codec and the transports that carry it.

A codec turns a request's bytes into the core's `Request` (and an encoder for its answer), and an
error into the protocol's own error body. It knows no web framework and no connection: a transport
(service.http.endpoint for HTTP) hands it the request's target, its headers and its body, and does
everything else through the core (service.core.dataplane): admission, the deadline, the decode on
the event loop or a thread, the batching, the metrics.

    target   (model, version) from the route: a path's, or (None, None) where the body names them
    headers  the request's headers, lower-case names and raw values
    body     bytes, or a memoryview where the transport wrote it into one aligned buffer
"""

from __future__ import annotations

from typing import Any, Protocol

from service.core.batching import Encoder
from service.core.cost import Cost
from service.core.errors import ServiceError
from service.core.request import Request

Target = tuple[str | None, str | None]  # (model, version) from the route
Headers = dict[bytes, bytes]
JSON = b"application/json"


class Codec(Protocol):
    def check_media_type(self, headers: Headers) -> None:
        """Raise UnsupportedMediaType for a body this protocol does not read."""

    def expected(self, headers: Headers, length: int) -> int:
        """What decoding a body of `length` bytes will hold at least, from the headers alone (before the
        body is read: service.core.cost)."""

    def aligned_at(self, headers: Headers) -> int | None:
        """Where a body that `decode` reads in place should be 64-byte aligned (None: it takes bytes)."""

    def decode(self, core: Any, target: Target, headers: Headers, body: bytes | memoryview, cost: Cost
               ) -> tuple[Request, Encoder]:
        """The request and the encoder of its answer. `core` is the dataplane (its registry and
        limits); what the decode holds is held in `cost` before it is made (service.core.cost's
        formulas). Raises ServiceError subclasses, with `.model` set once the model is known. Runs on
        the event loop or on a decode thread (the core decides by the body's size)."""

    def response(self, content: Any) -> tuple[bytes | list, list[tuple[bytes, bytes]], bytes]:
        """The encoder's result as (body or its parts, extra headers, content type)."""

    def error_body(self, error: ServiceError) -> bytes:
        """The protocol's error body for `error` (its status is `error.status`)."""


def media_type(headers: Headers) -> str | None:
    raw = headers.get(b"content-type")
    if raw is None:
        return None
    if raw == JSON:  # what nearly every client sends
        return "application/json"
    return raw.decode("latin-1").split(";")[0].strip().lower()
