"""`/attend`'s JSON body -> validated NumPy arrays, without a nested-list model on the way.

Two paths give the same arrays:

- Fast (every body): simdjson parses the body; each array field is exported as one flat buffer of
  doubles (`as_buffer`), its shape read from the lengths of its rows. `as_buffer` refuses anything but
  numbers (booleans, nulls, strings) and flattens nested arrays, so the shapes are also checked
  against the body's count of '[': an array nested where a number belongs adds brackets that no shape
  accounts for. Duplicate keys are counted on the parsed object (simdjson keeps them).
- Precise (only where the fast path cannot vouch for a field, which is a client error but for rare
  cases such as integers beyond 64 bits): the field as Python lists, walked row by row, naming the
  first element that is wrong (`keys[1][3] is null`, `queries is ragged: ...`).

Errors speak JSON, not Python: "got null", "got a string", never NoneType or NumPy's messages.
`build_request` then checks the arrays together against the model's signature; the Open Inference
Protocol's codec, which has arrays already, calls it too.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import orjson
import simdjson

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
from service.core.errors import (
    _EXCERPT,
    InvalidJSON,
    InvalidRequest,
    InvalidShape,
    ServiceError,
    UnsupportedMediaType,
    excerpt,
    json_type,
)
from service.core.request import (
    MAX_DIMS,
    Request,
    RequestLimits,
    _check_valid_lens,
    _checked_feed,
    _pattern,
    build_request,
    find_model,
    finite,
)
from service.core.runtime import LoadedModel, Registry
from service.protocols.codec import JSON, Answer, Headers, Target, media_type

DEFAULT_MODEL = "dot_product"
ARRAY_FIELDS = ("queries", "keys", "values", "scores")
FIELDS = ("model", "version", *ARRAY_FIELDS, "valid_lens", "return_weights")
_WHY_NOT = {
    "self_attention": ": its keys and values are the queries",
    "positional_encoding": ": it adds P to the queries",
    "masked_softmax": ": it takes the scores",
}
_FIELD_SET = frozenset(FIELDS)
DEFAULT_LIMITS = RequestLimits()
_NUMBERS = frozenset({int, float})
# Numbers beyond float32's range become inf in the cast and are refused just after; NumPy's warning
# about it would only repeat that (and np.errstate around every cast costs a microsecond a field).
warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning,
                        module=r"service\.(protocols\.attend|core\.request)")
# The small bodies' finiteness check (a dot product with zeros: NaN as soon as one number is not finite).
warnings.filterwarnings("ignore", message="invalid value encountered in dot", category=RuntimeWarning,
                        module=r"service\.protocols\.attend")


# ----------------------------------------------------------------------------------------- parsing


def _not_json(body: bytes) -> InvalidJSON:
    """Why orjson refuses the body, in JSON's words."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        token = body[e.pos:e.pos + 9].lstrip(b"-")
        if token.startswith((b"NaN", b"Infinity")):
            return InvalidJSON(f"the request body is not valid JSON: NaN and Infinity are not JSON numbers ({where})")
        if "infinity" in e.msg:
            return InvalidJSON(f"the request body is not valid JSON: a number is beyond a double's range ({where})")
        return InvalidJSON(f"the request body is not valid JSON: {e.msg} ({where})")
    return InvalidJSON("the request body is not valid JSON")


def _duplicate(keys: list[str]) -> None:
    if len(keys) != len(set(keys)):
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                raise InvalidJSON(f"duplicate key {excerpt(key)} in the request body", field=key[:_EXCERPT])
            seen.add(key)


_SIMDJSON_SAYS = {
    "BIGINT_ERROR": "an integer is beyond 64 bits (in a body over 1 MiB, write it as a float, e.g. 1e30)",
    "NUMBER_ERROR": "a number cannot be read (NaN and Infinity are not JSON numbers, nor is one beyond a double's "
                    "range)",
    "UTF8_ERROR": "it is not UTF-8",
    "UNCLOSED_STRING": "a string is not closed",
    "STRING_ERROR": "a string has an invalid escape",
}


def large_not_json(error: Exception) -> InvalidJSON:
    """Why simdjson refuses a body too large to be read again the slow way (which says where), in JSON's
    words."""
    code = str(error).split(":")[0]
    why = _SIMDJSON_SAYS.get(code, "a comma, bracket, brace, colon or key is missing or superfluous")
    return InvalidJSON(f"the request body is not valid JSON: {why}")


_threads = threading.local()


def _document(body: bytes) -> Any:
    """simdjson's parse of `body`. A small body takes its thread's own parser, kept from body to body:
    a fresh one would allocate buffers as large as the body each time. A larger
    body takes a fresh parser, whose buffers go with it; so does a small one while the thread's is busy
    (proxies of its last document still alive: an error's traceback can hold some)."""
    if len(body) > _SMALL_BODY:
        return simdjson.Parser().parse(body)
    parser = getattr(_threads, "parser", None)
    if parser is None:
        parser = _threads.parser = simdjson.Parser()
    try:
        return parser.parse(body)
    except RuntimeError as e:
        if "re-use a parser" not in str(e):
            raise
        return simdjson.Parser().parse(body)


def parse(body: bytes) -> dict[str, Any]:
    """The top-level object: values are simdjson proxies (arrays) or plain values. Raises InvalidJSON."""
    if not body:
        raise InvalidJSON("the request body is empty; expected a JSON object")
    try:
        document = _document(body)
    except (ValueError, RuntimeError, UnicodeDecodeError) as e:
        if len(body) > PRECISE_BODY_BYTES:  # the slow way holds every number as a Python object, twice
            raise large_not_json(e) from None
        return _parse_slowly(body)
    if not isinstance(document, simdjson.Object):
        raise InvalidJSON(f"the request body must be a JSON object, got {json_type(document)}")
    keys = list(document.keys())
    _duplicate(keys)
    try:
        return {key: document[key] for key in keys}
    except KeyError:  # simdjson cannot look up a key holding a NUL (\u0000) by name
        if len(body) > PRECISE_BODY_BYTES:
            raise InvalidJSON("a key of the request body holds a NUL character (\\u0000)") from None
        return _parse_slowly(body)


def _parse_slowly(body: bytes) -> dict[str, Any]:
    """What simdjson refuses: invalid JSON (orjson says why), or integers beyond 64 bits, which orjson
    reads as floats; duplicate keys then need the standard library's parser (only on this rare path)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _not_json(body) from None
    if not isinstance(data, dict):
        raise InvalidJSON(f"the request body must be a JSON object, got {json_type(data)}")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        _duplicate([key for key, _ in items])
        return dict(items)

    json.loads(body, object_pairs_hook=pairs)
    return data


# ------------------------------------------------------------------------------------------ arrays


def _fast_array(node: Any) -> tuple[np.ndarray, int] | None:
    """(float64 array, the number of JSON arrays it is made of), or None when the node is not a
    rectangular, non-empty array of numbers as far as can be told cheaply."""
    if type(node) is not simdjson.Array:
        return None
    shape = []
    probe = node
    while type(probe) is simdjson.Array:
        if len(shape) == MAX_DIMS or not len(probe):
            return None
        shape.append(len(probe))
        probe = probe[0]
    try:
        below = _rows([node], tuple(shape))
        if below is None:
            return None
        flat = np.frombuffer(node.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # a non-number somewhere
        return None
    if flat.size != math.prod(shape):
        return None
    return flat.reshape(shape), 1 + below


_ROWS_AT_ONCE = 16 * 1024  # rows of a depth looked at together (their proxies in memory, the GIL held)


def _rows(nodes: list[Any], shape: tuple[int, ...]) -> int | None:
    """The number of JSON arrays below `nodes` (arrays of length shape[0] each), when every row of every
    depth has its depth's length along the first path (`shape`); else None. Every row and its length in C
    loops (len() of a number raises; a string or an object among them is refused by as_buffer), about
    _ROWS_AT_ONCE rows at a time: a body of an array a number neither holds a proxy a number nor keeps the
    event loop's thread from the GIL for the whole walk."""
    if len(shape) == 1:
        return 0
    count = 0
    step = max(1, _ROWS_AT_ONCE // shape[0])
    for start in range(0, len(nodes), step):
        rows = list(chain.from_iterable(nodes[start:start + step]))
        if set(map(len, rows)) != {shape[1]}:
            return None
        below = _rows(rows, shape[1:])
        if below is None:
            return None
        count += len(rows) + below
    return count


# Bodies up to this size get one structural check of the whole body instead of a walk of every row.
_SMALL_BODY = 64 * 1024
_NOT_STRUCTURE = b"0123456789.eE+- \t\n\r"  # what numbers and blanks are made of
_ZEROS = np.zeros(_SMALL_BODY // 2, dtype=np.float32)  # as many as a small body has numbers ("0,": 2 bytes each)
_ZEROS.flags.writeable = False


def _finite(flat: np.ndarray) -> bool:
    """Every number of a small body's float32 array finite: x * 0 is 0 for those, NaN for inf (beyond
    float32) and NaN. One NumPy call where isfinite takes two and a Python wrapper."""
    if flat.size > _ZEROS.size:  # (where _SMALL_BODY was raised)
        return finite(flat)
    return flat.dot(_ZEROS[:flat.size]) == 0


def _first_path_shape(node: Any) -> tuple[int, ...] | None:
    """The shape along the first element of every level (rows not checked), or None if empty."""
    shape = []
    probe = node
    while probe.__class__ is simdjson.Array:
        n = len(probe)
        if not n or len(shape) == MAX_DIMS:
            return None
        shape.append(n)
        probe = probe[0]
    return tuple(shape)


@functools.lru_cache(maxsize=512)
def _skeleton(shape: tuple[int, ...]) -> bytes:
    """A rectangular array of numbers of `shape`, as JSON without its numbers: b"[[,,],[,,]]"."""
    text = b"[" + b"," * (shape[-1] - 1) + b"]"
    for n in reversed(shape[:-1]):
        text = b"[" + b",".join([text] * n) + b"]"
    return text


@functools.lru_cache(maxsize=64)
def _string_skeleton(text: str) -> bytes:
    return orjson.dumps(text).translate(None, _NOT_STRUCTURE)


def skeleton(body: bytes) -> bytes:
    """The body with its numbers and blanks taken out: its layout (b'{"quris":[[,],[,]],...}')."""
    return body.translate(None, _NOT_STRUCTURE)


def _structure_matches(layout: bytes, data: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the body's `skeleton` is exactly what its parse implies, every array a rectangle of
    its first path's shape holding numbers only (no row of another length, no array or string or
    literal where a number belongs). One C pass over the body instead of a Python walk of every row;
    False sends it the long way."""
    parts = []
    for key, value in data.items():
        if key in shapes:
            part = _skeleton(shapes[key])
        elif value is None:
            part = b"null"
        elif value is True or value is False:
            part = b"tru" if value else b"fals"
        elif isinstance(value, str):
            part = _string_skeleton(value)
        elif value.__class__ in _NUMBERS:  # a version
            part = b""
        else:
            return False
        parts.append(_string_skeleton(key) + b":" + part)
    return layout == b"{" + b",".join(parts) + b"}"


def _small_body_arrays(layout: bytes, data: dict[str, Any], fields: list[str]
                       ) -> tuple[dict[str, np.ndarray], np.ndarray | None] | None:
    """The fields' arrays (float32, finite) and the valid lengths (float64), when the body's
    `skeleton` passes `_structure_matches` and every number fits float32; else None (the long way
    names why).
    The numbers of all fields are cast and checked at once: each NumPy call has a fixed cost, and the
    book's examples have only a few hundred numbers."""
    shapes: dict[str, tuple[int, ...]] = {}
    buffers = []
    sizes = []
    lens = None
    for field in fields:
        node = data[field]
        if node.__class__ is not simdjson.Array:
            return None
        shape = _first_path_shape(node)
        if shape is None:
            return None
        try:
            buffer = node.as_buffer(of_type="d")
        except (TypeError, ValueError, RuntimeError):
            return None
        size = math.prod(shape)
        if buffer.size != 8 * size:  # bytes
            return None
        shapes[field] = shape
        if field == "valid_lens":
            lens = np.frombuffer(buffer, dtype=np.float64).reshape(shape)
        else:
            buffers.append(buffer)
            sizes.append(size)
    if not _structure_matches(layout, data, shapes):
        return None
    flat = np.frombuffer(b"".join(buffers), dtype=np.float64).astype(np.float32)
    if not _finite(flat):
        return None
    arrays, start = {}, 0
    for (field, shape), size in zip(shapes.items(), sizes, strict=False):  # valid_lens, where sent, is last
        arrays[field] = flat[start:start + size].reshape(shape)
        start += size
    return arrays, lens


def _count_brackets(body: bytes) -> int:
    """body.count(b"[") in NumPy's vector loops: faster than bytes.count on a large body."""
    return int(np.count_nonzero(np.frombuffer(body, dtype=np.uint8) == ord("[")))


def _as_python(node: Any) -> Any:
    return node.as_list() if isinstance(node, simdjson.Array) else node.as_dict() \
        if isinstance(node, simdjson.Object) else node


def _shape_of(value: Any, field: str, what: str) -> tuple[int, ...]:
    """The shape of a rectangular nested list of numbers; otherwise an error naming the first
    element that does not fit (in the order a reader would look for it)."""
    if not isinstance(value, list):
        raise InvalidRequest(f"{field} must be {what}, got {json_type(value)}", field=field)
    shape: list[int] = []
    probe = value
    while isinstance(probe, list):
        if len(shape) == MAX_DIMS:
            raise InvalidShape(f"{field} is nested deeper than {MAX_DIMS} levels; it must be {what}", field=field)
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    if shape[-1] == 0:
        return tuple(shape)  # empty somewhere along the first path: the caller names it
    level: list[tuple[str, Any]] = [(field, value)]
    for depth, size in enumerate(shape):
        last = depth == len(shape) - 1
        first = field + "[0]" * depth
        below = []
        for path, node in level:
            if not isinstance(node, list):
                raise InvalidShape(f"{field} is ragged: {path} is {json_type(node)} where {first} is an array",
                                   field=field)
            if len(node) != size:
                raise InvalidShape(f"{field} is ragged: {path} has {len(node)} items, {first} has {size}; "
                                   "every row must have the same length", field=field)
            if last:
                if set(map(type, node)) <= _NUMBERS:
                    continue
                for i, x in enumerate(node):
                    if type(x) not in _NUMBERS:
                        kind = "an array" if isinstance(x, list) else json_type(x)
                        raise (InvalidShape if kind == "an array" else InvalidRequest)(
                            f"{path}[{i}] is {kind}: {field} must hold only numbers", field=field)
            else:
                below.extend((f"{path}[{i}]", x) for i, x in enumerate(node))
        level = below
    return tuple(shape)


def _not_rectangular(field: str, what: str) -> InvalidShape:
    """The error of a field the fast path cannot read, in a body too large for the precise one (which
    would hold every number as a Python object to name the first that is wrong)."""
    return InvalidShape(f"{field} must be {what}: a row of another length, an array nested too deep, or a value "
                        "that is not a number is in it (bodies over 1 MiB are not searched for which)", field=field)


def _precise_array(node: Any, field: str, what: str) -> np.ndarray:
    value = _as_python(node)
    shape = _shape_of(value, field, what)
    if 0 in shape:
        return np.zeros(shape, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.array(value, dtype=np.float64)  # integers beyond a double become inf, refused later


@dataclass
class _Arrays:
    """The array fields of one body as float64, the JSON arrays they were made of, and whether
    every one took the fast path (only then does the body's count of '[' say anything)."""

    values: dict[str, np.ndarray]
    brackets: int = 0
    all_fast: bool = True


def _array(node: Any, field: str, what: str, arrays: _Arrays, precise: bool = True) -> np.ndarray:
    fast = _fast_array(node)
    if fast is None:
        arrays.all_fast = False
        if not precise:
            raise _not_rectangular(field, what)
        return _precise_array(node, field, what)
    arr, brackets = fast
    arrays.brackets += brackets
    return arr


# ------------------------------------------------------------------------------------------ checks


# ------------------------------------------------------------------------------------------ /attend


def resolve_model(data: dict[str, Any], registry: Registry) -> LoadedModel:
    unknown = [key for key in data if key not in _FIELD_SET]
    if unknown:
        raise InvalidRequest(f"unknown field {excerpt(unknown[0])}; expected: {', '.join(FIELDS)}",
                             field=unknown[0][:_EXCERPT])
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
                                 expected=_pattern(model, field))
        if field not in wanted and data.get(field) is not None:
            raise InvalidRequest(f"model {model.name} ({model.kind}) takes no {field}{_WHY_NOT.get(model.kind, '')}",
                                 field=field, expected=sorted(wanted))
    lens = data.get("valid_lens")
    if lens is not None and "valid_lens" not in wanted:
        raise InvalidRequest(f"model {model.name} ({model.kind}) takes no valid_lens{_WHY_NOT.get(model.kind, '')}",
                             field="valid_lens", expected=sorted(wanted))
    if layout is not None:
        fields = [f for f in ARRAY_FIELDS if f in wanted] + (["valid_lens"] if lens is not None else [])
        small = _small_body_arrays(layout, data, fields)
        if small is not None:
            tensors, sent_lens = small
            feed, lengths = _checked_feed(model, tensors, limits, True)
            if "valid_lens" in wanted:
                feed["valid_lens"] = _check_valid_lens(sent_lens, *lengths)
            memo = _remember(model, layout, data, limits, tensors, sent_lens, lengths)
            return Request(model, feed, return_weights, memo)
    arrays = _Arrays({})
    what = "an array of arrays of arrays of numbers (batch, n, features)"
    if model.kind == "masked_softmax":
        what = "an array of arrays of arrays of numbers (batch, n_q, n_k)"
    precise = body is None or len(body) <= PRECISE_BODY_BYTES
    for field in ARRAY_FIELDS:
        if field in wanted:
            arrays.values[field] = _array(data[field], field, what, arrays, precise)
    lens_what = "null or an array of integers (batch) or (batch, n_q)"
    if lens is not None:
        lens = _array(lens, "valid_lens", lens_what, arrays, precise)
    if body is not None and arrays.all_fast and (_count_brackets(body) if brackets is None else brackets) \
            != arrays.brackets:
        # An array nested where a number belongs (as_buffer flattened it): the precise path names it.
        if not precise:
            fields = [*arrays.values, *(["valid_lens"] if lens is not None else [])]
            raise InvalidShape(f"an array is nested where a number belongs in {' or '.join(fields)} (bodies over "
                               "1 MiB are not searched for which)", field=fields[0])
        for field in arrays.values:
            arrays.values[field] = _precise_array(data[field], field, what)
        if lens is not None:
            lens = _precise_array(data["valid_lens"], "valid_lens", "an array of integers")
    return build_request(model, arrays.values, lens, return_weights, limits)


def decode_body(body: bytes, registry: Registry, limits: RequestLimits = DEFAULT_LIMITS,
                brackets: int | None = None) -> Request:
    """POST /attend's body -> Request. Raises ServiceError subclasses for bad input, with `.model`
    set to the model's name once it is known (for the metrics' label). `brackets`: the body's count of
    '[', where the caller has it."""
    data = parse(body)
    model = resolve_model(data, registry)
    layout = None
    if len(body) <= _SMALL_BODY:
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


# ------------------------------------------------------------------------------------------- plans
#
# Clients send the same layout again and again: the same keys, model and shapes, other numbers.
# Every check of a small body but those of its numbers depends only on its keys and its `skeleton`
# (the body without numbers and blanks, which fixes every array's shape and that it holds only
# numbers, and the type of every other value), so a layout that passed them once leaves a plan on
# the model's snapshot, and the next body of that layout is only parsed, cast and checked for what
# its numbers can get wrong: finite float32, and whole valid lengths within n_k. (The model and
# version are resolved from each body, and a body whose numbers fail is decoded the long way,
# which names the field.) On the book's multi-head example the plan saves much of the decode.

_PLANS_PER_MODEL = 64  # layouts kept a snapshot (at most a small body's size each); then it starts over
# Making a plan costs its body time, which only later bodies of its layout win back. So a layout gets one
# when it comes a second time among the last
# _LAYOUTS_SEEN layouts (their hashes: ints, ~60 bytes each): varied bodies, which rarely come twice, are
# spared making plans they would never use.
_LAYOUTS_SEEN = 4 * _PLANS_PER_MODEL


@dataclass(frozen=True, slots=True)
class _Plan:
    keys: tuple[str, ...]  # the body's keys, in order (the skeleton strips digits and 'e' from strings)
    limits: RequestLimits  # what the shapes were checked against
    arrays: tuple[tuple[str, tuple[int, ...], int, int], ...]  # input, shape, its start and end in the numbers
    lens_shape: tuple[int, ...] | None  # the valid lengths' shape, where the body has them
    takes_lens: bool  # the model has a valid_lens input (absent or null: every key valid)
    lengths: tuple[int, int, int]  # batch, n_q, n_k
    memo: dict[str, Any]  # Request.memo of this layout's requests

    def request(self, model: LoadedModel, data: dict[str, Any]) -> Request | None:
        """The request from a body of this layout; None where its numbers fail a check."""
        if data[self.arrays[0][0]].__class__ is not simdjson.Array:
            return None  # parsed the slow way (integers beyond 64 bits): Python lists
        try:
            buffers = [data[name].as_buffer(of_type="d") for name, _, _, _ in self.arrays]
        except (TypeError, ValueError, RuntimeError):
            return None
        flat = np.frombuffer(b"".join(buffers), dtype=np.float64).astype(np.float32)
        if not _finite(flat):
            return None
        feed = {name: flat[start:end].reshape(shape) for name, shape, start, end in self.arrays}
        if self.takes_lens:
            lens = self._valid_lens(data)
            if lens is None:
                return None
            feed["valid_lens"] = lens
        return Request(model, feed, data.get("return_weights", True), self.memo)

    def _valid_lens(self, data: dict[str, Any]) -> np.ndarray | None:
        """(batch, n_q) int64, or None where the body's lengths are not whole numbers within n_k."""
        try:
            lens = None
            if self.lens_shape is not None:  # else absent or null: every key
                lens = np.frombuffer(data["valid_lens"].as_buffer(of_type="d"), dtype=np.float64)
                lens = lens.reshape(self.lens_shape)
            return _check_valid_lens(lens, *self.lengths)
        except (TypeError, ValueError, RuntimeError, ServiceError):
            return None


def _remember(model: LoadedModel, layout: bytes, data: dict[str, Any], limits: RequestLimits,
              tensors: dict[str, np.ndarray], lens: np.ndarray | None, lengths: tuple[int, int, int]
              ) -> dict[str, Any] | None:
    """Leave the plan of a small body that passed every check on its model's snapshot, where its layout
    was seen before; its memo (None for a layout seen the first time)."""
    seen = model.body_layouts_seen
    key = hash(layout)
    if key not in seen:
        if len(seen) >= _LAYOUTS_SEEN:
            seen.clear()
        seen.add(key)
        return None
    arrays, start = [], 0
    for name, array in tensors.items():  # in the order of the body's numbers (_small_body_arrays')
        arrays.append((name, array.shape, start, start + array.size))
        start += array.size
    plans = model.body_plans
    if len(plans) >= _PLANS_PER_MODEL:
        plans.clear()
    plan = plans[layout] = _Plan(tuple(data), limits, tuple(arrays), None if lens is None else lens.shape,
                                 "valid_lens" in model.input_names, lengths, {})
    return plan.memo


_ORJSON = orjson.OPT_SERIALIZE_NUMPY


def encode_attend(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool = True) -> bytes:
    """/attend's response body: the model and its version (a string, as the Open Inference Protocol's
    `model_version`), `outputs`, `attention_weights` (null when not asked for, or for a model without),
    and any other output of the model (`P` of the positional encoding)."""
    body: dict[str, Any] = {"model": model.name, "model_version": model.version_text, "outputs": outputs["outputs"],
                            "attention_weights": outputs.get("attention_weights") if return_weights else None}
    if len(outputs) > 2 or "attention_weights" not in outputs:
        body.update((name, value) for name, value in outputs.items() if name not in body)
    return orjson.dumps(body, option=_ORJSON)


def encode_answer(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool) -> Answer:
    """The codec's encoder: the body, with the X-Model-Version header of the model that answered."""
    return Answer(encode_attend(model, outputs, return_weights), model.version_headers, JSON, model)


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
        cost.decoding(json_decode(size, commas, brackets))
        return decode_body(body, core.registry, core.limits, brackets), encode_answer

    def error_body(self, error: ServiceError) -> bytes:
        return orjson.dumps(error.body())
