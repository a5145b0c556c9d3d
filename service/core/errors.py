"""One error table: a `ServiceError` subclass per condition, one status each. Each protocol renders
it in its own body (service.http.app and the /attend codec as the service's one error body, the
Open Inference Protocol as its `{"error": "<message>"}`):

    {"error": {"code": "invalid_shape", "message": "...", "field": "keys",
               "expected": [2, "n_k", 2], "received": [2, 10, 3]}}

Each class says what it means (its docstring's first paragraph) and what to do (`advice`): `python
scripts/errors_table.py` writes them, with the status and the code, into docs/errors.md, and
tests/service/test_errors_table.py fails where that table is stale or a class lacks either.
"""

from __future__ import annotations

import logging
from typing import Any

import simdjson

log = logging.getLogger("service")


class ServiceError(Exception):
    """Something failed inside the service: a bug, not the request (its log line has the traceback)."""

    status = 500
    code = "internal_error"
    advice = ("Retry once; if it persists, report it with the response's X-Request-ID: the service's log line with "
              "that ID has the traceback.")

    def __init__(self, message: str, field: str | None = None, expected: Any = None, received: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.expected = expected
        self.received = received
        self.headers = headers
        self.model: str | None = None  # set once the request's model is known
        self.version: int | None = None  # ... and its version, where a body named it (the statistics')

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
    """The body is not valid JSON: a syntax error, NaN or Infinity, a duplicate key."""

    status, code = 400, "invalid_json"
    advice = "Send one JSON object; the message names the line and column. NaN and Infinity are not JSON numbers."


class InvalidEncoding(ServiceError):
    """A compressed body that does not inflate (Content-Encoding)."""

    status, code = 400, "invalid_encoding"
    advice = "Send whole gzip or deflate data as Content-Encoding says, or the body uncompressed without the header."


class InvalidHeader(ServiceError):
    """A request header the service reads has a value it cannot use (X-Request-Timeout-Ms)."""

    status, code = 400, "invalid_header"
    advice = "Send X-Request-Timeout-Ms as a positive number of milliseconds, or leave it out."


class Unauthorized(ServiceError):
    """An API key is needed (ATTEND_API_KEYS; ATTEND_ADMIN_KEYS for model control), and none or a wrong one came."""

    status, code = 401, "unauthorized"
    advice = "Send `Authorization: Bearer <key>` with one of the service's keys."


class ModelNotFound(ServiceError):
    """No model of that name, or that version of it is not loaded."""

    status, code = 404, "model_not_found"
    advice = ("GET /models lists the models and their loaded versions; ATTEND_KEEP_VERSIONS=2 keeps the previous "
              "version addressable.")


class ControlOff(ServiceError):
    """An admin call is off: model control (load, unload, the repository index), or a change of the log settings."""

    status, code = 404, "not_found"
    advice = "Set ATTEND_ADMIN_KEYS and send one of them, or ATTEND_MODEL_CONTROL=true on a trusted network."


class RouteNotFound(ServiceError):
    """No route at this path."""

    status, code = 404, "not_found"
    advice = "Check the path: GET /docs lists the routes (inference is POST /attend and POST /v2/models/{m}/infer)."


class MethodNotAllowed(ServiceError):
    """The route exists, but not with this method."""

    status, code = 405, "method_not_allowed"
    advice = "Use the method GET /docs gives the route (inference is POST)."


class HTTPError(ServiceError):
    """Any other refusal of the web framework, with its own status."""

    status, code = 400, "http_error"
    shown_status = "4xx"  # the framework's (service.http.app)
    advice = "Read the message; GET /docs documents every route."


class RequestTimeout(ServiceError):
    """The request's headers or body came too slowly (the connection is closed after the answer)."""

    status, code = 408, "request_timeout"
    advice = ("Send the whole request promptly (ATTEND_HEADER_TIMEOUT_S, ATTEND_BODY_TIMEOUT_S, "
              "ATTEND_MIN_BODY_RATE); on a slow link, raise them.")


# A control call's body or message is a few hundred bytes; past this, PayloadTooLarge. Parsed on the event loop,
# 32 MiB of JSON settings (the body limit) took 1.5 s and 312 MiB there (orjson, 2.4 M keys); as a gRPC
# TraceSettingRequest, 5.6 s.
CONTROL_BODY_BYTES = 64 * 1024


class PayloadTooLarge(ServiceError):
    """The body, or what it asks for, is over a limit; the message names the setting."""

    status, code = 413, "payload_too_large"
    advice = ("Split the request (fewer rows, shorter sequences), or raise the setting the message names "
              "(ATTEND_MAX_BODY_BYTES, ATTEND_MAX_INFLATE_RATIO, ATTEND_MAX_BATCH, ATTEND_MAX_SEQUENCE, "
              "ATTEND_MAX_FEATURES, ATTEND_MAX_WEIGHT_ELEMENTS, ATTEND_MAX_INFLIGHT_BYTES).")


class UnsupportedMediaType(ServiceError):
    """A Content-Type the endpoint does not read."""

    status, code = 415, "unsupported_media_type"
    advice = ("/attend takes application/json; /v2 inference application/json, application/octet-stream or "
              "none.")


class InvalidRequest(ServiceError):
    """A field of the right JSON type with the wrong value, or of the wrong type."""

    status, code = 422, "invalid_request"
    advice = "`field`, `expected` and `received` say which and what; GET /models/{m} gives the model's inputs."


class InvalidShape(InvalidRequest):
    """An array whose shape does not fit the model or the other arrays."""

    code = "invalid_shape"
    advice = ("Compare `expected` (sizes by name: n_k is the keys' length) with `received`; GET /models/{m} "
              "lists the input shapes.")


class NotFinite(InvalidRequest):
    """The inputs are finite, but the model's outputs for them are not: a score q·k/√d or a projection passed
    float32's largest number (3.4e38), and its softmax is NaN, as in the PyTorch modules."""

    code = "not_finite"
    advice = ("Send smaller numbers: the scores q·k/√d, and the projections of multi_head, self_attention and "
              "additive, must stay within float32's range.")


class HeadersTooLarge(ServiceError):
    """The request's headers are over ATTEND_MAX_HEADER_BYTES."""

    status, code = 431, "headers_too_large"
    advice = "Send fewer or shorter headers (cookies, tokens), or raise ATTEND_MAX_HEADER_BYTES."


class ClientGone(ServiceError):
    """The client disconnected while its request waited (nobody reads the answer)."""

    status, code = 499, "client_closed_request"
    advice = ("Nothing is sent: it is counted (status 499 in the metrics) and logged. A client that gives up "
              "early may want a longer timeout.")


class ModelUnavailable(ServiceError):
    """The model could not be loaded at start (ATTEND_SKIP_BROKEN_MODELS kept the service up without it)."""

    status, code = 503, "model_unavailable"
    advice = "GET /models/{m} says why; fix the version (python -m export), then reload (SIGHUP or the load route)."


class NotReady(ServiceError):
    """The service is starting or stopping, or a model it should serve could not be loaded."""

    status, code = 503, "not_ready"
    advice = ("Retry after Retry-After seconds; GET /health/ready turns 200 once it serves. Still 503: GET "
              "/models says which model failed.")


class Overloaded(ServiceError):
    """Too much at once: the queue, the memory budget or the connections are full; the message says which."""

    status, code = 503, "overloaded"
    advice = ("Retry after Retry-After seconds, with backoff. Steadily: add workers or replicas, or raise the "
              "limit: ATTEND_MAX_QUEUE, ATTEND_MAX_INFLIGHT_BYTES, ATTEND_MAX_CONNECTIONS, "
              "ATTEND_MAX_OPEN_CONNECTIONS.")


class OutOfDeviceMemory(ServiceError):
    """A run did not fit in the execution provider's memory (the GPU's): nothing was answered but this."""

    status, code = 503, "out_of_device_memory"
    advice = ("Retry after Retry-After seconds, or send a smaller request. Steadily: set ATTEND_MAX_DEVICE_BYTES "
              "lower, so that such requests are refused before they run, or run fewer ATTEND_WORKERS on the GPU.")


class DeadlineExceeded(ServiceError):
    """The request's deadline (ATTEND_REQUEST_TIMEOUT_S, or X-Request-Timeout-Ms) passed before it ran."""

    status, code = 504, "deadline_exceeded"
    advice = ("Allow more time (X-Request-Timeout-Ms, ATTEND_REQUEST_TIMEOUT_S); steady 504s mean the service is "
              "saturated: add capacity.")


EXCERPT = 64  # characters of a client's string quoted back in an error


def excerpt(text: str) -> str:
    """A client's string as quoted in an error: at most a short prefix of it."""
    return repr(text) if len(text) <= EXCERPT else repr(text[:EXCERPT]) + f"... ({len(text)} characters)"


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
