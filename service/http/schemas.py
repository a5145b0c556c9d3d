"""Pydantic models for the OpenAPI document only: requests are parsed with orjson straight into
NumPy (service.protocols.attend), which is several times faster than nested-list models for MB of floats."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, Field


def toy_request() -> dict[str, Any]:
    """The book's toy additive example: queries (2, 1, 20), keys of ones (2, 10, 2), values
    arange(40) as (10, 4) twice, valid lengths [2, 6]; the outputs are [[2, 3, 4, 5]] and
    [[10, 11, 12, 13]] whatever the queries."""
    rng = np.random.default_rng(0)
    values = np.arange(40, dtype=np.float32).reshape(1, 10, 4).repeat(2, axis=0)
    return {
        "model": "additive",
        "queries": np.round(rng.normal(size=(2, 1, 20)), 3).tolist(),
        "keys": np.ones((2, 10, 2)).tolist(),
        "values": values.tolist(),
        "valid_lens": [2, 6],
        "return_weights": True,
    }


Array3D = list[list[list[float]]]


class AttendRequest(BaseModel):
    model: str = Field("dot_product", description="a model of GET /models")
    version: int | None = Field(None, ge=1, description="a loaded version of the model to address (GET /models "
                                "lists them; ATTEND_KEEP_VERSIONS=2 keeps the previous one); absent or null: the "
                                "newest served")
    queries: Array3D | None = Field(None, description="(batch, n_q, query_size); for self_attention and "
                                    "positional_encoding the input sequence (batch, n, d); omitted for masked_softmax")
    keys: Array3D | None = Field(None, description="(batch, n_k, key_size); omitted for self_attention")
    values: Array3D | None = Field(None, description="(batch, n_k, value_size); omitted for self_attention")
    scores: Array3D | None = Field(None, description="(batch, n_q, n_k): masked_softmax's input only")
    valid_lens: list[int] | list[list[int]] | None = Field(
        None, description="absent/null (all keys), (batch,) or (batch, n_q); each 0 <= length <= n_k. "
        "A length of 0 attends to nothing: zero weights and a zero output row.")
    return_weights: bool = Field(True, description="false leaves attention_weights null (a smaller response)")


class AttendResponse(BaseModel):
    model: str
    model_version: str = Field(description="the version of the model that answered (also the X-Model-Version "
                               "header), a string as in the Open Inference Protocol")
    outputs: Array3D = Field(description="(batch, n_q, output_size); for masked_softmax the weights")
    attention_weights: list[Any] | None = Field(
        description="(batch, n_q, n_k), or (batch, num_heads, n_q, n_k) for multi_head and self_attention; "
        "null for positional_encoding")
    P: list[list[float]] | None = Field(None, description="positional_encoding only: P[:n], (n, d)")


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None
    expected: Any = None
    received: Any = None


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERROR_TEXT = {
    400: "The body is not a JSON object (invalid JSON, NaN/Infinity tokens, duplicate keys)",
    401: "An API key is needed (ATTEND_API_KEYS is set) and none or a wrong one was given",
    404: "Unknown model",
    413: "The body, or what it asks for, is over a limit (ATTEND_MAX_*); the message names it",
    415: "Content-Type is not application/json",
    422: "A field has the wrong type, shape or value; `field`, `expected` and `received` say which",
    503: "Not ready (loading, or shutting down), a model that could not be loaded, or overloaded "
         "(the queue is full; see Retry-After)",
    504: "The deadline (ATTEND_REQUEST_TIMEOUT_S, or X-Request-Timeout-Ms) passed before the request ran",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, all with the one error body."""
    return {status: {"model": ErrorBody, "description": _ERROR_TEXT[status]} for status in statuses}


class ProtocolError(BaseModel):
    """The Open Inference Protocol's error body."""

    error: str


def protocol_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of the /v2 routes: the protocol's error body."""
    text = {400: "The model or version is not there (the ready route's 'false')", 401: _ERROR_TEXT[401],
            404: "Unknown model, or a version that is not loaded", 413: "The body is over ATTEND_MAX_BODY_BYTES",
            422: "A path parameter is malformed",
            503: "Not ready, or a model that could not be loaded"}
    return {status: {"model": ProtocolError, "description": text[status]} for status in statuses}
