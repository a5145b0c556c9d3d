"""One error table: a `ServiceError` subclass per condition, one status each. Each protocol renders
it in its own body (service.http.app and the /attend codec as the service's one error body, the
Open Inference Protocol as its `{"error": "<message>"}`):

    {"error": {"code": "invalid_shape", "message": "...", "field": "keys",
               "expected": [2, "n_k", 2], "received": [2, 10, 3]}}
"""

from __future__ import annotations

import logging
from typing import Any

import simdjson

log = logging.getLogger("service")


class ServiceError(Exception):
    status = 500
    code = "internal_error"

    def __init__(self, message: str, field: str | None = None, expected: Any = None, received: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.expected = expected
        self.received = received
        self.headers = headers
        self.model: str | None = None  # set once the request's model is known

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.expected is not None:
            error["expected"] = self.expected
        if self.received is not None:
            error["received"] = self.received
        return {"error": error}


class InvalidJSON(ServiceError):
    status, code = 400, "invalid_json"


class InvalidEncoding(ServiceError):
    """A compressed body that does not inflate (Content-Encoding)."""

    status, code = 400, "invalid_encoding"


class InvalidHeader(ServiceError):
    status, code = 400, "invalid_header"


class ModelNotFound(ServiceError):
    status, code = 404, "model_not_found"


class PayloadTooLarge(ServiceError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(ServiceError):
    status, code = 415, "unsupported_media_type"


class InvalidRequest(ServiceError):
    """A field of the right JSON type with the wrong value, or of the wrong type."""

    status, code = 422, "invalid_request"


class InvalidShape(InvalidRequest):
    code = "invalid_shape"


class ModelUnavailable(ServiceError):
    status, code = 503, "model_unavailable"


class NotReady(ServiceError):
    status, code = 503, "not_ready"


class Overloaded(ServiceError):
    """The batch queue is full (ATTEND_MAX_QUEUE)."""

    status, code = 503, "overloaded"


class RequestTimeout(ServiceError):
    """The request's headers or body came too slowly (the connection is closed after the answer)."""

    status, code = 408, "request_timeout"


class HeadersTooLarge(ServiceError):
    status, code = 431, "headers_too_large"


class DeadlineExceeded(ServiceError):
    status, code = 504, "deadline_exceeded"


class ClientGone(ServiceError):
    """The client disconnected while its request waited (nobody reads the answer)."""

    status, code = 499, "client_closed_request"


_EXCERPT = 64  # characters of a client's string quoted back in an error


def excerpt(text: str) -> str:
    """A client's string as quoted in an error: at most a short prefix of it."""
    return repr(text) if len(text) <= _EXCERPT else repr(text[:_EXCERPT]) + f"... ({len(text)} characters)"


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | simdjson.Array):
        return "an array"
    return "an object"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class ControlOff(ServiceError):
    status, code = 404, "not_found"
