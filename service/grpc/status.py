"""The one error table (service.core.errors: a status per condition) said in gRPC's status codes: each
`ServiceError` becomes the code of its HTTP status, and its message the status details, with the
`expected` and `received` of a shape error appended (gRPC has no error body for them).

    400, 415, 422  INVALID_ARGUMENT     a request it cannot read, or of the wrong shape or value
    401            UNAUTHENTICATED      no API key, or a wrong one (`authorization` metadata)
    403            PERMISSION_DENIED
    404            NOT_FOUND            no such model or version; model control off
    408, 504       DEADLINE_EXCEEDED    the deadline (grpc-timeout, x-request-timeout-ms) passed
    413, 431       RESOURCE_EXHAUSTED   over a limit: the message names the setting
    429            RESOURCE_EXHAUSTED
    499            CANCELLED            the client went away (counted, nothing is sent)
    501            UNIMPLEMENTED
    503            UNAVAILABLE          not ready, stopping, overloaded: retry (the message says which)
    else           INTERNAL
"""

from __future__ import annotations

import grpc
import orjson

from service.core.errors import ServiceError

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def end_call(context: grpc.aio.ServicerContext, error: ServiceError, trailing: tuple[tuple[str, str], ...] = ()
             ) -> None:
    """Ends the call with the error's status code, details and trailing metadata once its handler returns
    (what it returns is discarded). Not `context.abort`: grpc keeps the AbortError it raises on the call,
    so the error's frames (the request message among them) stayed in a reference cycle until a full
    collection, tens of MiB a refused call (docs/reliability.md)."""
    context.set_code(code_of(error))
    context.set_details(details_of(error))
    context.set_trailing_metadata(metadata_of(error) + trailing)


def code_of(error: ServiceError) -> grpc.StatusCode:
    return CODES.get(error.status, grpc.StatusCode.INTERNAL)


def details_of(error: ServiceError) -> str:
    """The status details: the message, and where the error has them, what was expected and received."""
    details = error.message
    if error.expected is not None:
        details += f" (expected {_shown(error.expected)}"
        details += f", received {_shown(error.received)})" if error.received is not None else ")"
    return details


def metadata_of(error: ServiceError) -> tuple[tuple[str, str], ...]:
    """The error's headers (Retry-After, WWW-Authenticate) as trailing metadata."""
    return tuple((name.lower(), value) for name, value in (error.headers or {}).items())


def _shown(value: object) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return str(value)
