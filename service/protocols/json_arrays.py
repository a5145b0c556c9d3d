"""JSON to validated NumPy arrays without a nested-list model on the way: simdjson's parse, each array read
as one flat buffer of doubles with its shape from its rows (the fast way), and the slow, precise way that
names the first wrong element where the fast one cannot vouch for a field.

Errors speak JSON, not Python: "got null", "got a string", never NoneType or NumPy's messages.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, NamedTuple

import numpy as np
import orjson
import simdjson

from service.core.cost import PRECISE_BODY_BYTES
from service.core.errors import EXCERPT, InvalidJSON, InvalidRequest, InvalidShape, excerpt, json_type
from service.core.request import MAX_DIMS, finite

# Numbers beyond float32's range become inf in the cast and are refused just after; NumPy's warning
# about it would only repeat that (and np.errstate around every cast costs a microsecond a field).
warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning,
                        module=r"service\.(protocols\.(json_arrays|json_process|layouts|v2)|core\.request)")


_NUMBERS = frozenset({int, float})


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
                raise InvalidJSON(f"duplicate key {excerpt(key)} in the request body", field=key[:EXCERPT])
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


def _document(body: bytes, parser: simdjson.Parser | None = None) -> Any:
    """simdjson's parse of `body`. A small body takes its thread's own parser, kept from body to body:
    a fresh one would allocate buffers as large as the body each time. A larger
    body takes a fresh parser, whose buffers go with it, unless the caller gives one (a decode process's);
    so does a body while the parser is busy (proxies of its last document still alive: an error's traceback
    can hold some)."""
    if parser is None and len(body) > SMALL_BODY:
        return simdjson.Parser().parse(body)
    parser = parser or getattr(_threads, "parser", None)
    if parser is None:
        parser = _threads.parser = simdjson.Parser()
    try:
        return parser.parse(body)
    except RuntimeError as e:
        if "re-use a parser" not in str(e):
            raise
        return simdjson.Parser().parse(body)


def parse(body: bytes, fields: Collection[str], parser: simdjson.Parser | None = None) -> dict[str, Any]:
    """The top-level object: values are simdjson proxies (arrays) or plain values. Raises InvalidJSON.
    `fields`: the keys it may hold. Of an object with more, only the first len(fields) + 1 are read, among
    which one is unknown or repeated: simdjson finds a key by reading the keys before it, so reading all
    of an object's keys takes their square (40 k keys took 5.4 s of a decode thread, 2 M would take days).
    `parser`: the one to use, for any body (see `_document`)."""
    if not body:
        raise InvalidJSON("the request body is empty; expected a JSON object")
    try:
        document = _document(body, parser)
    except (ValueError, RuntimeError, UnicodeDecodeError) as e:
        if len(body) > PRECISE_BODY_BYTES:  # the slow way holds every number as a Python object, twice
            raise large_not_json(e) from None
        return _parse_slowly(body)
    if not isinstance(document, simdjson.Object):
        raise InvalidJSON(f"the request body must be a JSON object, got {json_type(document)}")
    keys = list(islice(document, len(fields) + 1))  # an object's iterator yields its keys
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


class Read(NamedTuple):
    """An array a decode process read the fast way (service.protocols.json_process): fast_array's answer."""

    array: np.ndarray
    brackets: int


def fast_array(node: Any) -> tuple[np.ndarray, int] | None:
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
SMALL_BODY = 64 * 1024


_NOT_STRUCTURE = b"0123456789.eE+- \t\n\r"  # what numbers and blanks are made of


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


def small_body_arrays(layout: bytes, data: dict[str, Any], fields: list[str]
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
    if not finite(flat):
        return None
    arrays, start = {}, 0
    for (field, shape), size in zip(shapes.items(), sizes, strict=False):  # valid_lens, where sent, is last
        arrays[field] = flat[start:start + size].reshape(shape)
        start += size
    return arrays, lens


def count_brackets(body: bytes) -> int:
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


def precise_array(node: Any, field: str, what: str) -> np.ndarray:
    value = _as_python(node)
    shape = _shape_of(value, field, what)
    if 0 in shape:
        return np.zeros(shape, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.array(value, dtype=np.float64)  # integers beyond a double become inf, refused later


@dataclass
class Arrays:
    """The array fields of one body as float64, the JSON arrays they were made of, and whether
    every one took the fast path (only then does the body's count of '[' say anything)."""

    values: dict[str, np.ndarray]
    brackets: int = 0
    all_fast: bool = True


def array_of(node: Any, field: str, what: str, arrays: Arrays, precise: bool = True) -> np.ndarray:
    fast = node if node.__class__ is Read else fast_array(node)  # Read: a decode process's fast_array
    if fast is None:
        arrays.all_fast = False
        if not precise:
            raise _not_rectangular(field, what)
        return precise_array(node, field, what)
    arr, brackets = fast
    arrays.brackets += brackets
    return arr
