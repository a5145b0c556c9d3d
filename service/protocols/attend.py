"""POST /attend's codec: its JSON body to a validated `Request` (service.protocols.json_arrays reads the arrays,
service.protocols.layouts remembers the layouts that passed), and the answer back to JSON.

`build_request` (service.core.request) then checks the arrays together against the model's signature; the
Open Inference Protocol's codec, which has arrays already, calls it too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import orjson

from service.core.batching import Encoder
from service.core.cost import (
    PRECISE_BODY_BYTES,
    ROUGH_JSON_BYTES,
    SMALL_JSON_BYTES,
    Cost,
    json_bound,
    json_counts,
    json_decode,
    json_expected,
)
from service.core.deadline import on_thread
from service.core.errors import (
    EXCERPT,
    InvalidRequest,
    InvalidShape,
    ServiceError,
    UnsupportedMediaType,
    excerpt,
    json_type,
)
from service.core.request import (
    Request,
    RequestLimits,
    build_request,
    check_valid_lens,
    checked_feed,
    find_model,
    pattern,
)
from service.core.runtime import LoadedModel, Registry
from service.protocols.codec import JSON, Answer, Headers, Target, dumps, json_parts, media_type
from service.protocols.json_arrays import (
    SMALL_BODY,
    Arrays,
    array_of,
    count_brackets,
    parse,
    precise_array,
    skeleton,
    small_body_arrays,
)
from service.protocols.json_process import read_fields
from service.protocols.layouts import remember

DEFAULT_MODEL = "dot_product"
ARRAY_FIELDS = ("queries", "keys", "values", "scores")
FIELDS = ("model", "version", *ARRAY_FIELDS, "valid_lens", "return_weights")
_WHY_NOT = {
    "self_attention": ": its keys and values are the queries",
    "positional_encoding": ": it adds P to the queries",
    "masked_softmax": ": it takes the scores",
}
_FIELD_SET = frozenset(FIELDS)
# A decode process's reader: the fields, and those it reads as arrays, in the dtype the service casts each to.
_IN_PROCESS = partial(read_fields, fields=_FIELD_SET, arrays_in={**dict.fromkeys(ARRAY_FIELDS, "<f4"),
                                                                 "valid_lens": "<f8"})
DEFAULT_LIMITS = RequestLimits()



# ------------------------------------------------------------------------------------------ /attend


def resolve_model(data: dict[str, Any], registry: Registry) -> LoadedModel:
    unknown = [key for key in data if key not in _FIELD_SET]
    if unknown:
        raise InvalidRequest(f"unknown field {excerpt(unknown[0])}; expected: {', '.join(FIELDS)}",
                             field=unknown[0][:EXCERPT])
    name = data.get("model", DEFAULT_MODEL)
    if not isinstance(name, str):
        raise InvalidRequest(f"model must be a string (a name of GET /models), got {json_type(name)}", field="model")
    version = data.get("version")
    if version is not None and (version.__class__ is not int or version < 1):
        raise InvalidRequest(f"version must be a positive integer, got {json_type(version)}", field="version")
    return find_model(registry, name, version, "model", "version")


def decode(data: dict[str, Any], model: LoadedModel, limits: RequestLimits = DEFAULT_LIMITS,
           body: bytes | None = None, layout: bytes | None = None, brackets: int | None = None) -> Request:
    """The request for `model` from the parsed body `data` (values simdjson proxies or plain).
    `layout`: a small body's `skeleton` (its one structural check; a body whose checks pass then
    leaves its plan on the model, for the next body of the same layout). `brackets`: the body's
    count of '[', where the caller has it (service.core.cost.json_counts)."""
    return_weights = data.get("return_weights", True)
    if not isinstance(return_weights, bool):
        raise InvalidRequest(f"return_weights must be true or false, got {json_type(return_weights)}",
                             field="return_weights")
    wanted = model.input_names
    for field in ARRAY_FIELDS:
        if field in wanted and data.get(field) is None:
            raise InvalidRequest(f"{field} is required for model {model.name}", field=field,
                                 expected=pattern(model, field))
        if field not in wanted and data.get(field) is not None:
            raise InvalidRequest(f"model {model.name} ({model.kind}) takes no {field}{_WHY_NOT.get(model.kind, '')}",
                                 field=field, expected=sorted(wanted))
    lens = data.get("valid_lens")
    if lens is not None and "valid_lens" not in wanted:
        raise InvalidRequest(f"model {model.name} ({model.kind}) takes no valid_lens{_WHY_NOT.get(model.kind, '')}",
                             field="valid_lens", expected=sorted(wanted))
    if layout is not None:
        fields = [f for f in ARRAY_FIELDS if f in wanted] + (["valid_lens"] if lens is not None else [])
        small = small_body_arrays(layout, data, fields)
        if small is not None:
            tensors, sent_lens = small
            feed, lengths = checked_feed(model, tensors, limits, True)
            if "valid_lens" in wanted:
                feed["valid_lens"] = check_valid_lens(sent_lens, *lengths)
            memo = remember(model, layout, data, limits, tensors, sent_lens, lengths)
            return Request(model, feed, return_weights, memo)
    arrays = Arrays({})
    what = "an array of arrays of arrays of numbers (batch, n, features)"
    if model.kind == "masked_softmax":
        what = "an array of arrays of arrays of numbers (batch, n_q, n_k)"
    precise = body is None or len(body) <= PRECISE_BODY_BYTES
    for field in ARRAY_FIELDS:
        if field in wanted:
            arrays.values[field] = array_of(data[field], field, what, arrays, precise)
    lens_what = "null or an array of integers (batch) or (batch, n_q)"
    if lens is not None:
        lens = array_of(lens, "valid_lens", lens_what, arrays, precise)
    if body is not None and arrays.all_fast and (count_brackets(body) if brackets is None else brackets) \
            != arrays.brackets:
        # An array nested where a number belongs (as_buffer flattened it): the precise path names it.
        if not precise:
            fields = [*arrays.values, *(["valid_lens"] if lens is not None else [])]
            raise InvalidShape(f"an array is nested where a number belongs in {' or '.join(fields)} (bodies over "
                               "1 MiB are not searched for which)", field=fields[0])
        for field in arrays.values:
            arrays.values[field] = precise_array(data[field], field, what)
        if lens is not None:
            lens = precise_array(data["valid_lens"], "valid_lens", "an array of integers")
    return build_request(model, arrays.values, lens, return_weights, limits)


def decode_body(body: bytes, registry: Registry, limits: RequestLimits = DEFAULT_LIMITS,
                brackets: int | None = None) -> Request:
    """POST /attend's body -> Request. Raises ServiceError subclasses for bad input, with `.model`
    set to the model's name once it is known (for the metrics' label). `brackets`: the body's count of
    '[', where the caller has it."""
    return decode_parsed(parse(body, _FIELD_SET), body, registry, limits, brackets)


def decode_parsed(data: dict[str, Any], body: Any, registry: Registry, limits: RequestLimits = DEFAULT_LIMITS,
                  brackets: int | None = None) -> Request:
    """decode_body after the parse (`data`: `parse`'s, or a decode process's: service.protocols.json_process)."""
    model = resolve_model(data, registry)
    layout = None
    if len(body) <= SMALL_BODY:
        layout = skeleton(body)
        plan = model.body_plans.get(layout)
        if plan is not None and plan.limits is limits and plan.keys == tuple(data):
            request = plan.request(model, data)
            if request is not None:
                return request
    try:
        return decode(data, model, limits, body, layout, brackets)
    except ServiceError as e:
        e.model, e.version = model.name, model.config.version
        raise


def encode_attend(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool = True) -> bytes:
    """/attend's response body: the model and its version (a string, as the Open Inference Protocol's
    `model_version`), `outputs`, `attention_weights` (null when not asked for, or for a model without),
    and any other output of the model (`P` of the positional encoding)."""
    return dumps(*_answer(model, outputs, return_weights))


def attend_parts(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool = True) -> bytes | list:
    """encode_attend's body, in parts where it is large (service.protocols.codec.json_parts)."""
    return json_parts(*_answer(model, outputs, return_weights))


def _answer(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool) -> tuple[dict[str, Any], int]:
    """The body's fields, and the numbers its arrays hold."""
    body: dict[str, Any] = {"model": model.name, "model_version": model.version_text, "outputs": outputs["outputs"],
                            "attention_weights": outputs.get("attention_weights") if return_weights else None}
    if len(outputs) > 2 or "attention_weights" not in outputs:
        body.update((name, value) for name, value in outputs.items() if name not in body)
    return body, sum([a.size for name, a in outputs.items() if return_weights or name != "attention_weights"])


def encode_answer(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool) -> Answer:
    """The codec's encoder: the body, with the X-Model-Version header of the model that answered."""
    return Answer(attend_parts(model, outputs, return_weights), model.version_headers, JSON, model)


def attend(body: bytes, registry: Registry, limits: RequestLimits = DEFAULT_LIMITS) -> bytes:
    """Decode, run and encode one request, in the calling thread, with no queue: the in-process
    benchmark's and the tests' reference."""
    request = decode_body(body, registry, limits)
    return encode_attend(request.model, request.model.run(request.feed, request.return_weights), request.return_weights)


class AttendCodec:
    """POST /attend: JSON in (`decode_body`), JSON out (`encode_answer`), errors in the service's one
    error body (service.core.errors.ServiceError.body)."""

    def check_media_type(self, headers: Headers) -> None:
        media = media_type(headers)
        if media is not None and media not in ("application/json", "") and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, got {media[:100]}",
                                       expected="application/json", received=media[:100])

    def expected(self, headers: Headers, length: int) -> int:
        return json_expected(length)

    def aligned_at(self, headers: Headers) -> None:
        return None

    def decode(self, core: Any, target: Target, headers: Headers, body: bytes, cost: Cost) -> tuple[Request, Encoder]:
        size = len(body)
        if size <= SMALL_JSON_BYTES:  # its bound from its size, held since it arrived (where it was not inflated)
            cost.at_least(size + json_expected(size), "decoding this body")
            return decode_body(body, core.registry, core.limits), encode_answer
        if size <= ROUGH_JSON_BYTES and cost.roughly(size + json_bound(size)):
            return decode_body(body, core.registry, core.limits), encode_answer
        commas, brackets = json_counts(body)
        processes = getattr(core, "json_processes", None)
        if processes is not None and size > PRECISE_BODY_BYTES:  # (a small body's errors need its parse: precise)
            # The parse in a process (service.protocols.json_process), and the body's copy it reads.
            cost.decoding(json_decode(size, commas, brackets) + size)
            data = processes.parse(body, _IN_PROCESS, getattr(on_thread, "until", None))
            if data is not None:  # else the process, or its reader, failed: parsed here
                return decode_parsed(data, body, core.registry, core.limits, brackets), encode_answer
        else:
            cost.decoding(json_decode(size, commas, brackets))
        return decode_body(body, core.registry, core.limits, brackets), encode_answer

    def error_body(self, error: ServiceError) -> bytes:
        return orjson.dumps(error.body())
