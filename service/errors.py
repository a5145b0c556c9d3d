"""One error table and one error body, everywhere (FastAPI's own validation errors included).

    {"error": {"code": "invalid_shape", "message": "...", "field": "keys",
               "expected": [2, "n_k", 2], "received": [2, 10, 3]}}
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

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


class DeadlineExceeded(ServiceError):
    status, code = 504, "deadline_exceeded"


class ClientGone(ServiceError):
    """The client disconnected while its request waited (nobody reads the answer)."""

    status, code = 499, "client_closed_request"


def error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or str(loc[-1] if loc else "")


def _body(request: Request, error: ServiceError) -> dict[str, Any]:
    """The one error body, but under /v2 the Open Inference Protocol's: {"error": "<message>"}."""
    return {"error": error.message} if request.url.path.startswith("/v2") else error.body()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(exc.status, _body(request, exc), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        err = InvalidRequest(first["msg"], field=_field_of(tuple(first["loc"])))
        return error_response(err.status, _body(request, err))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        error = ServiceError(str(exc.detail))
        error.status, error.code = exc.status_code, code
        return error_response(exc.status_code, _body(request, error), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # Logged with its traceback here; the client gets a plain 500, never the traceback.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, {"error": {"code": "internal_error", "message": "internal server error"}})
