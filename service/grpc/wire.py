"""What protobuf's parse of a message would build, read off its bytes before it is parsed.

upb parses a whole message while holding the GIL, and builds an object for each field: a 32 MiB
ModelInferRequest of empty `inputs` (16 M fields) took 2.1 s of the event loop and 1.3 GiB, 16 M empty
`raw_input_contents` 0.8 s and 416 MiB, 2 M `parameters` 0.8 s (AMD EPYC, upb 6); packed int64 values of one
byte each take eight times their bytes. A message over SCAN_BYTES is walked first, through its schema's
message fields (a packed array's values are not read): past MAX_FIELDS fields, or with values that take
more than the limit parsed, it is refused unparsed. Below SCAN_BYTES the worst parse builds 32 k objects:
about 4 ms and 3 MB.

The walk also lifts a request's tensors out (`split`): upb copies each raw_input_contents into the parsed
message, and again into the bytes that reading it makes, both holding the GIL (`python bench/grpc_read.py`);
so it does a tensor's packed fp32_contents and fp64_contents (little-endian values, as raw contents are).
Lifted, they are views of the message's bytes, read by the decode; the lengths of the messages that held
them are rewritten."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from service.core.errors import InvalidRequest, PayloadTooLarge

SCAN_BYTES = 64 * 1024
# A request for these models has a few dozen fields; a tensor's values are one field each when packed
# (every protobuf library's default for proto3), one a value otherwise.
MAX_FIELDS = 4096

_T = FieldDescriptor
# Bytes a parsed value of a packed varint array takes: at least one byte each on the wire.
_VARINT_BYTES = {_T.TYPE_INT64: 8, _T.TYPE_UINT64: 8, _T.TYPE_SINT64: 8, _T.TYPE_INT32: 4, _T.TYPE_UINT32: 4,
                 _T.TYPE_SINT32: 4, _T.TYPE_ENUM: 4, _T.TYPE_BOOL: 1}


@dataclass(frozen=True)
class _Field:
    name: str
    schema: dict[int, _Field] | None  # a message's fields, by number
    value_bytes: int  # a repeated varint's: the bytes a value takes parsed (0: not one)


def schema(descriptor: Descriptor, made: dict[str, dict[int, _Field]] | None = None) -> dict[int, _Field]:
    """`descriptor`'s fields by number, with those of the messages it holds."""
    made = {} if made is None else made
    if descriptor.full_name in made:  # a message that holds its own kind
        return made[descriptor.full_name]
    fields: dict[int, _Field] = made.setdefault(descriptor.full_name, {})
    for f in descriptor.fields:
        if f.type == _T.TYPE_MESSAGE:
            fields[f.number] = _Field(f.name, schema(f.message_type, made), 0)
        else:
            fields[f.number] = _Field(f.name, None, _VARINT_BYTES.get(f.type, 0) if f.is_repeated else 0)
    return fields


# The fields a request's tensors are lifted out of, by path: bytes, or packed fixed-width little-endian values.
RAW = "raw_input_contents"
LIFTED = frozenset({RAW, "inputs.contents.fp32_contents", "inputs.contents.fp64_contents"})


class Received(NamedTuple):
    """A ModelInferRequest as the guard read it: `message` parsed without the tensors lifted out of it; `raw` its
    raw_input_contents where they were (views of the bytes received), `typed` its packed contents by input's
    index and field name (the views of each one's parts, in order)."""

    message: Any
    raw: list[memoryview] | None = None
    typed: dict[tuple[int, str], list[memoryview]] | None = None

    @property
    def raw_input_contents(self) -> Any:
        """The message's raw_input_contents, lifted or not."""
        return self.message.raw_input_contents if self.raw is None else self.raw


def parsed_bytes(message: bytes, fields: dict[int, _Field], limit: int,
                 setting: str = "ATTEND_MAX_BODY_BYTES") -> int:
    """The bytes `message` takes parsed (itself, and what its packed varints grow to); raises InvalidRequest
    past MAX_FIELDS fields, PayloadTooLarge over `limit` (the `setting`'s), DecodeError where it is not
    a message."""
    return _walked(message, fields, limit, setting).size


def split(message: bytes, fields: dict[int, _Field], limit: int, setting: str, lift: frozenset[str] = LIFTED
          ) -> tuple[int, bytes, list[memoryview], dict[tuple[int, str], list[memoryview]]]:
    """parsed_bytes(message); the message without the fields at the paths `lift` (bytes); and those fields'
    values as views of `message`: the raw ones in order, the typed ones as Received.typed. Raises as
    parsed_bytes."""
    walk = _walked(message, fields, limit, setting, lift)
    # A packed array also sent unpacked would be split in two, its order lost: such a message is parsed whole.
    lifted = [leaf for leaf in walk.lifted if leaf.path == RAW or not walk.unpacked]
    if not lifted:
        return walk.size, message, [], {}
    view = memoryview(message)
    raw: list[memoryview] = []
    typed: dict[tuple[int, str], list[memoryview]] = {}
    for leaf in lifted:
        if leaf.path == RAW:
            raw.append(view[leaf.start:leaf.stop])
        else:
            key = (leaf.enclosing[0].index, leaf.path.rpartition(".")[2])
            typed.setdefault(key, []).append(view[leaf.start:leaf.stop])
    return walk.size, b"".join(_without(view, 0, len(message), lifted, 0)), raw, typed


def _without(view: memoryview, pos: int, end: int, lifted: list[_Lifted], depth: int) -> list[Any]:
    """The parts of view[pos:end] without the `lifted` fields in it, with the lengths of the messages that
    held them rewritten."""
    parts: list[Any] = []
    for node, leaves in itertools.groupby(lifted, lambda leaf: leaf.enclosing[depth:depth + 1]):
        if not node:  # lifted from this message itself
            for leaf in leaves:
                parts.append(view[pos:leaf.at])
                pos = leaf.stop
            continue
        (node,) = node
        body = _without(view, node.start, node.stop, list(leaves), depth + 1)
        parts += [view[pos:node.length_at], varint(sum(map(len, body)))] + body
        pos = node.stop
    parts.append(view[pos:end])
    return parts


def varint(value: int) -> bytes:
    """`value` as protobuf writes a varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _walked(message: bytes, fields: dict[int, _Field], limit: int, setting: str,
            lift: frozenset[str] = frozenset()) -> _Walk:
    walk = _Walk(message, lift)
    walk.message(0, len(message), fields, "")
    size = len(message) + walk.grown
    if size > limit:
        raise PayloadTooLarge(f"the message would take {size} bytes parsed (its packed integers grow, most at "
                              f"{walk.widest}), over the limit of {limit} ({setting}): send the "
                              "tensors in raw_input_contents", field=walk.widest, expected=limit, received=size)
    walk.size = size
    return walk


class _Node(NamedTuple):
    """A message field, at `at`, its length's varint at `length_at`, its value view[start:stop]; `index`: its
    place among the top-level fields of its number (an input's index)."""

    at: int
    length_at: int
    start: int
    stop: int
    index: int


class _Lifted(NamedTuple):
    path: str
    enclosing: tuple[_Node, ...]  # the message fields that hold it, outermost first
    at: int
    start: int
    stop: int


class _Walk:
    def __init__(self, data: bytes, lift: frozenset[str] = frozenset()):
        self.data = data
        self.lift = lift  # paths of the fields lifted out
        self.names = {path.rpartition(".")[2] for path in lift}  # their names: most fields are not one
        self.lifted: list[_Lifted] = []
        self.unpacked = False  # a lifted path's values also sent one a field
        self.open: list[_Node] = []  # the message fields the walk is in
        self.seen: dict[int, int] = {}  # top-level message fields so far, by number
        self.size = 0
        self.fields = 0
        self.grown = 0  # bytes the packed varints take parsed beyond their bytes on the wire
        self.widest, self.most = "", 0  # the array that grows most, and by how much

    def varint(self, pos: int) -> tuple[int, int]:
        data, value, shift = self.data, 0, 0
        while True:
            if pos >= len(data) or shift > 63:
                raise DecodeError("a truncated varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7

    def message(self, pos: int, end: int, fields: dict[int, _Field], path: str) -> None:
        data = self.data
        while pos < end:
            at, byte = pos, data[pos]
            tag, pos = (byte, pos + 1) if byte < 0x80 else self.varint(pos)
            self.fields += 1
            field = fields.get(tag >> 3)
            if self.fields > MAX_FIELDS:
                where = path + (field.name if field else f"field {tag >> 3}")
                raise InvalidRequest(f"the message has over {MAX_FIELDS} fields (at {where}); a request has a few "
                                     "dozen, with each tensor's values packed (protobuf's default) or in "
                                     "raw_input_contents", field=where)
            kind = tag & 7
            if kind == 0:
                _, pos = self.varint(pos)
            elif kind == 1 or kind == 5:
                if field is not None and field.name in self.names and path + field.name in self.lift:
                    self.unpacked = True
                pos += 8 if kind == 1 else 4
            elif kind == 2:
                length_at = pos
                size, pos = self.varint(pos)
                stop = pos + size
                if stop > end:
                    raise DecodeError("a field runs past its message")
                if field is not None:
                    if field.name in self.names and path + field.name in self.lift:
                        self.lifted.append(_Lifted(path + field.name, tuple(self.open), at, pos, stop))
                    elif field.schema is not None:
                        index = 0
                        if not path:
                            index = self.seen.get(tag >> 3, 0)
                            self.seen[tag >> 3] = index + 1
                        self.open.append(_Node(at, length_at, pos, stop, index))
                        self.message(pos, stop, field.schema, f"{path}{field.name}.")
                        self.open.pop()
                    elif field.value_bytes > 1:  # packed
                        grown = size * (field.value_bytes - 1)
                        self.grown += grown
                        if grown > self.most:
                            self.widest, self.most = path + field.name, grown
                pos = stop
            else:
                raise DecodeError("a group, or no wire type")
        if pos != end:
            raise DecodeError("a field runs past its message")
