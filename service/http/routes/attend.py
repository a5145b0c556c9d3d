"""POST /attend: the codec of the service's own JSON protocol.

The body decodes with service.protocols.attend, which encodes the response too; errors have the one
error body of service.core.errors. Everything else (request ID, limits, deadline, batching, metrics) is
service.http.endpoint's, the same for every protocol. The FastAPI route
below only documents the endpoint in the OpenAPI schema.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.http.schemas import AttendRequest, AttendResponse, error_responses, toy_request

router = APIRouter()


@router.post(
    "/attend",
    response_model=AttendResponse,
    responses={200: {"headers": {"X-Model-Version": {"description": "the version of the model that answered",
                                                     "schema": {"type": "string"}}}},
               **error_responses(400, 401, 404, 413, 415, 422, 503, 504)},  # type: ignore[dict-item]
    summary="Attention outputs and weights for queries, keys, values and valid lengths",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": AttendRequest.model_json_schema(),
        "example": toy_request(),
    }}}},
)
async def attend_documented() -> None:
    """The OpenAPI entry of POST /attend; requests are served by the inference endpoint
    (service.http.endpoint), routed before it."""
    raise NotImplementedError("POST /attend is served by service.http.endpoint.InferenceEndpoint")
