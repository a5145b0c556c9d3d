"""POST /attend: the codec of the service's own JSON protocol.

The body decodes with service.protocols.attend, which encodes the response too; errors have the one
error body of service.core.errors. Everything else (request ID, limits, deadline, batching, metrics) is
service.http.endpoint's, the same for every protocol. The FastAPI route
below only documents the endpoint in the OpenAPI schema.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.types import Scope

from service.core.batching import Encoder
from service.core.errors import ServiceError, UnsupportedMediaType
from service.core.request import Request
from service.http.endpoint import InferenceEndpoint, media_type
from service.http.schemas import AttendRequest, AttendResponse, error_responses, toy_request
from service.protocols.attend import decode_body, encode_attend

router = APIRouter()


@router.post(
    "/attend",
    response_model=AttendResponse,
    responses=error_responses(400, 401, 404, 413, 415, 422, 503, 504),  # type: ignore[arg-type]
    summary="Attention outputs and weights for queries, keys, values and valid lengths",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": AttendRequest.model_json_schema(),
        "example": toy_request(),
    }}}},
)
async def attend_documented() -> None:
    """The OpenAPI entry of POST /attend; requests are served by `AttendEndpoint`, routed before it."""
    raise NotImplementedError("POST /attend is served by service.http.routes.attend.AttendEndpoint")


class AttendEndpoint(InferenceEndpoint):
    """POST /attend: JSON in (service.protocols.attend), JSON out (its encode_attend)."""

    def check_media_type(self, headers: dict[bytes, bytes]) -> None:
        media = media_type(headers)
        if media is not None and media not in ("application/json", "") and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, got {media[:100]}",
                                       expected="application/json", received=media[:100])

    async def decode(self, scope: Scope, headers: dict[bytes, bytes], body: bytes,
                     until: float) -> tuple[Request, Encoder]:
        return await self.dataplane.decode_async(self._decode, body, until), encode_attend

    def _decode(self, body: bytes) -> Request:
        return decode_body(body, self.dataplane.registry, self.dataplane.limits)

    def error_body(self, error: ServiceError) -> bytes:
        return orjson.dumps(error.body())
