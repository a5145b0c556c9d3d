"""JSON body -> validated NumPy arrays, without a nested-list pydantic model on the way.

orjson parses the body; each array field becomes one NumPy array, checked for type, rank,
emptiness and finiteness; the shapes are then checked together against the model's declared
signature (`export.repository.signature`), naming the field, the expected and the received shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from export.repository import TensorSpec, valid_lens_2d
from service.errors import (
    InvalidJSON,
    InvalidRequest,
    InvalidShape,
    ModelNotFound,
    ModelUnavailable,
    PayloadTooLarge,
)
from service.runtime import LoadedModel, Registry

DEFAULT_MODEL = "dot_product"
ARRAY_FIELDS = ("queries", "keys", "values")
FIELDS = {"model", *ARRAY_FIELDS, "valid_lens", "return_weights"}
_F32_MAX = float(np.finfo(np.float32).max)
_MAX_DEPTH = 8


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (ATTEND_MAX_*); beyond it: 413 naming the limit."""

    batch: int = 1024
    sequence: int = 4096
    features: int = 4096
    weight_elements: int = 4 * 1024 * 1024


@dataclass
class Request:
    model: LoadedModel
    feed: dict[str, np.ndarray]  # the graph's inputs, valid_lens already 2-D int64
    return_weights: bool


def _numeric_array(value: Any, field: str) -> np.ndarray:
    if not isinstance(value, list):
        raise InvalidRequest(f"{field} must be a nested list of numbers, got {type(value).__name__}", field=field)
    depth, probe = 0, value
    while isinstance(probe, list) and probe and depth <= _MAX_DEPTH:
        probe, depth = probe[0], depth + 1
    if depth > _MAX_DEPTH:  # absurdly deep: refuse before numpy walks it (a few levels get the rank error)
        raise InvalidShape(f"{field} is nested deeper than {_MAX_DEPTH} levels; it must be 3-D", field=field)
    try:
        arr = np.array(value)
    except (ValueError, TypeError, RecursionError) as e:
        # numpy names the inhomogeneous axis: "... after 1 dimensions. The detected shape was (2,) + ..."
        raise InvalidShape(f"{field} is ragged: every row must have the same length ({e})", field=field) from e
    if arr.dtype.kind not in "iuf":
        if arr.dtype.kind == "O":
            raise InvalidShape(f"{field} is ragged or holds non-numbers: every row must have the same length",
                               field=field)
        if arr.size == 0:
            return arr.astype(np.float64)
        what = {"b": "booleans", "U": "strings"}.get(arr.dtype.kind, str(arr.dtype))
        raise InvalidRequest(f"{field} must contain only numbers, got {what}", field=field)
    return arr


def _float_array(value: Any, field: str, model: LoadedModel) -> np.ndarray:
    arr = _numeric_array(value, field)
    if arr.ndim != 3:
        raise InvalidShape(f"{field} must be 3-D (batch, n, features), got {arr.ndim}-D", field=field,
                           expected=_pattern(model, field), received=list(arr.shape))
    if arr.size == 0:
        raise InvalidShape(f"{field} must not be empty", field=field, expected=_pattern(model, field),
                           received=list(arr.shape))
    with np.errstate(over="ignore"):  # beyond float32's range becomes inf, refused just below
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise InvalidRequest(f"{field} must hold finite float32 numbers (|x| <= {_F32_MAX:.4g})", field=field)
    return arr


def _pattern(model: LoadedModel, field: str, bound: dict[str, int] | None = None) -> list[int | str]:
    spec = next(s for s in model.inputs() if s.name == field)
    bound = bound or {}
    return [bound.get(d, d) if isinstance(d, str) else d for d in spec.shape]


def _bind(spec: TensorSpec, arr: np.ndarray, bound: dict[str, int], first_seen: dict[str, str],
          model: LoadedModel) -> None:
    """Match `arr.shape` to `spec.shape`: fixed sizes must be equal, a named axis takes the size
    of its first occurrence (batch, n_k, d ...) and every later occurrence must agree."""
    before = dict(bound)  # the expected shape is stated with what the other fields fixed
    for axis, (want, got) in enumerate(zip(spec.shape, arr.shape, strict=True)):
        if isinstance(want, int):
            if got != want:
                raise InvalidShape(
                    f"{spec.name} must have {want} features (axis {axis}) for model {model.name}, got {got}",
                    field=spec.name, expected=_pattern(model, spec.name, before), received=list(arr.shape))
        elif want in bound:
            if got != bound[want]:
                other = first_seen[want]
                raise InvalidShape(
                    f"{spec.name} has {want} = {got} on axis {axis}, but {other} has {want} = {bound[want]}",
                    field=spec.name, expected=_pattern(model, spec.name, before), received=list(arr.shape))
        else:
            bound[want] = got
            first_seen[want] = spec.name


def _valid_lens(value: Any, batch: int, n_q: int, n_k: int) -> np.ndarray:
    if value is None:
        return valid_lens_2d(None, batch, n_q, n_k)
    field = "valid_lens"
    expected = f"null, [batch] = [{batch}] or [batch, n_q] = [{batch}, {n_q}]"
    if not isinstance(value, list):
        raise InvalidRequest(f"valid_lens must be null or a list of integers, got {type(value).__name__}",
                             field=field, expected=expected)
    arr = _numeric_array(value, field)
    if arr.size and arr.dtype.kind == "f":
        raise InvalidRequest("valid_lens must be integers", field=field, expected=expected)
    if arr.shape not in ((batch,), (batch, n_q)):
        raise InvalidShape(f"valid_lens must have shape (batch,) or (batch, n_q), got {arr.shape}", field=field,
                           expected=expected, received=list(arr.shape))
    if arr.size and (arr.min() < 0 or arr.max() > n_k):
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise InvalidRequest(f"valid_lens must be between 0 and n_k = {n_k}, got {bad}", field=field,
                             expected=f"0 <= valid_len <= {n_k}", received=bad)
    return valid_lens_2d(arr, batch, n_q, n_k)


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise InvalidJSON("the request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidJSON(f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidJSON(f"the request body must be a JSON object, got {type(data).__name__}")
    _refuse_duplicate_keys(body, data)
    return data


def _refuse_duplicate_keys(body: bytes, data: dict[str, Any]) -> None:
    """orjson keeps the last of duplicate keys silently. Only the top level can hold keys (every
    other value is a number array), so a cheap count finds candidates and the slow parser with
    `object_pairs_hook` confirms them; any escape (a key spelled with \\u...) takes the slow path."""
    # Each key brings two quotes, and so does each string value; a duplicate key brings two that
    # the parsed object does not account for (as do escaped quotes, which take the slow path too).
    quotes = 2 * (len(data) + sum(isinstance(v, str) for v in data.values()))
    if body.count(b'"') == quotes and b"\\" not in body:  # one byte: a memchr, not a substring search
        return

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen = set()
        for key, _ in items:
            if key in seen:
                raise InvalidJSON(f"duplicate key {key!r} in the request body", field=key)
            seen.add(key)
        return dict(items)

    json.loads(body, object_pairs_hook=pairs)


def resolve_model(data: dict[str, Any], registry: Registry) -> LoadedModel:
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}; expected: {', '.join(sorted(FIELDS))}",
                             field=unknown[0])
    name = data.get("model", DEFAULT_MODEL)
    if not isinstance(name, str):
        raise InvalidRequest(f"model must be a string, got {type(name).__name__}", field="model")
    model = registry.get(name)
    if model is None and name in registry.broken:
        raise ModelUnavailable(f"model {name!r} could not be loaded: {registry.broken[name]}", field="model")
    if model is None:
        raise ModelNotFound(f"unknown model {name!r}; available: {', '.join(registry.names())}", field="model")
    return model


def _check_limits(limits: RequestLimits, model: LoadedModel, batch: int, n_q: int, n_k: int,
                  feed: dict[str, np.ndarray]) -> None:
    def refuse(what: str, got: int, limit: int, setting: str, field: str = "queries") -> None:
        raise PayloadTooLarge(f"{what} is {got}, over this service's limit of {limit} ({setting})", field=field,
                              expected=f"<= {limit}", received=got)

    if batch > limits.batch:
        refuse("batch", batch, limits.batch, "ATTEND_MAX_BATCH")
    if n_q > limits.sequence:
        refuse("n_q", n_q, limits.sequence, "ATTEND_MAX_SEQUENCE")
    if n_k > limits.sequence:
        refuse("n_k", n_k, limits.sequence, "ATTEND_MAX_SEQUENCE", "keys")
    for name, arr in feed.items():
        if arr.shape[-1] > limits.features:
            refuse(f"the feature size of {name}", arr.shape[-1], limits.features, "ATTEND_MAX_FEATURES", name)
    elements = batch * int(model.config.hyperparameters.get("num_heads", 1)) * n_q * n_k
    if elements > limits.weight_elements:
        refuse("batch * heads * n_q * n_k (the attention weights)", elements, limits.weight_elements,
               "ATTEND_MAX_WEIGHT_ELEMENTS")


def decode(data: dict[str, Any], model: LoadedModel, limits: RequestLimits = RequestLimits()) -> Request:
    """The request for `model` from the parsed JSON object `data`."""
    return_weights = data.get("return_weights", True)
    if not isinstance(return_weights, bool):
        raise InvalidRequest(f"return_weights must be true or false, got {type(return_weights).__name__}",
                             field="return_weights")

    specs = [s for s in model.inputs() if s.name != "valid_lens"]
    wanted = {s.name for s in specs}
    for field in ARRAY_FIELDS:
        if field in wanted and data.get(field) is None:
            raise InvalidRequest(f"{field} is required for model {model.name}", field=field,
                                 expected=_pattern(model, field))
        if field not in wanted and data.get(field) is not None:
            raise InvalidRequest(f"model {model.name} ({model.kind}) takes no {field}: its keys and values are "
                                 "the queries", field=field)
    bound: dict[str, int] = {}
    first_seen: dict[str, str] = {}
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        arr = _float_array(data[spec.name], spec.name, model)
        _bind(spec, arr, bound, first_seen, model)
        feed[spec.name] = arr

    batch = bound["batch"]
    n_q = bound.get("n_q", bound.get("n", 0))
    n_k = bound.get("n_k", bound.get("n", 0))
    max_len = model.config.hyperparameters.get("max_len")
    if max_len is not None and n_q > max_len:
        raise InvalidShape(f"queries is a sequence of {n_q} tokens, longer than the model's max_len {max_len}",
                           field="queries", expected=[batch, f"n <= {max_len}", _pattern(model, "queries")[-1]],
                           received=list(feed["queries"].shape))
    _check_limits(limits, model, batch, n_q, n_k, feed)
    feed["valid_lens"] = _valid_lens(data.get("valid_lens"), batch, n_q, n_k)
    return Request(model=model, feed=feed, return_weights=return_weights)
