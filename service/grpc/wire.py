"""What protobuf's parse of a message would build, read off its bytes before it is parsed.

upb parses a whole message while holding the GIL, and builds an object for each field: a 32 MiB
ModelInferRequest of empty `inputs` (16 M fields) took 2.1 s of the event loop and 1.3 GiB, 16 M empty
`raw_input_contents` 0.8 s and 416 MiB, 2 M `parameters` 0.8 s (AMD EPYC, upb 6); packed int64 values of one
byte each take eight times their bytes. A message over SCAN_BYTES is walked first, through its schema's
message fields (a packed array's values are not read): past MAX_FIELDS fields, or with values that take
more than the limit parsed, it is refused unparsed. Below SCAN_BYTES the worst parse builds 32 k objects:
about 4 ms and 3 MB.

The walk also lifts a request's tensors out (`split`): upb copies each raw_input_contents into the parsed
message, and again into the bytes that reading it makes, both holding the GIL (`python bench/grpc_read.py`).
Lifted, they are views of the message's bytes, read by the decode."""

from __future__ import annotations

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


class Received(NamedTuple):
    """A ModelInferRequest as the guard read it: `message` parsed without its raw_input_contents where `raw`
    holds them (views of the bytes received), or whole where `raw` is None."""

    message: Any
    raw: list[memoryview] | None = None

    @property
    def raw_input_contents(self) -> Any:
        """The message's raw_input_contents, lifted or not."""
        return self.message.raw_input_contents if self.raw is None else self.raw


def parsed_bytes(message: bytes, fields: dict[int, _Field], limit: int,
                 setting: str = "ATTEND_MAX_BODY_BYTES") -> int:
    """The bytes `message` takes parsed (itself, and what its packed varints grow to); raises InvalidRequest
    past MAX_FIELDS fields, PayloadTooLarge over `limit` (the `setting`'s), DecodeError where it is not
    a message."""
    return _walked(message, fields, limit, setting, 0).size


def split(message: bytes, fields: dict[int, _Field], limit: int, setting: str, lift: int
          ) -> tuple[int, bytes, list[memoryview]]:
    """parsed_bytes(message), the message without its fields number `lift` (bytes, at the top level), and those
    fields' values as views of `message`, in order. Raises as parsed_bytes."""
    walk = _walked(message, fields, limit, setting, lift)
    if not walk.lifted:
        return walk.size, message, []
    view, rest, at = memoryview(message), [], 0
    for field, _, stop in walk.lifted:
        rest.append(view[at:field])
        at = stop
    rest.append(view[at:])
    return walk.size, b"".join(rest), [view[start:stop] for _, start, stop in walk.lifted]


def _walked(message: bytes, fields: dict[int, _Field], limit: int, setting: str, lift: int) -> _Walk:
    walk = _Walk(message, lift)
    walk.message(0, len(message), fields, "")
    size = len(message) + walk.grown
    if size > limit:
        raise PayloadTooLarge(f"the message would take {size} bytes parsed (its packed integers grow, most at "
                              f"{walk.widest}), over the limit of {limit} ({setting}): send the "
                              "tensors in raw_input_contents", field=walk.widest, expected=limit, received=size)
    walk.size = size
    return walk


class _Walk:
    def __init__(self, data: bytes, lift: int = 0):
        self.data = data
        self.lift = lift  # a top-level field number whose values are lifted out (0: none)
        self.lifted: list[tuple[int, int, int]] = []  # each one's (field, value, end) offsets
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
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                size, pos = self.varint(pos)
                stop = pos + size
                if stop > end:
                    raise DecodeError("a field runs past its message")
                if tag >> 3 == self.lift and not path:
                    self.lifted.append((at, pos, stop))
                elif field is not None:
                    if field.schema is not None:
                        self.message(pos, stop, field.schema, f"{path}{field.name}.")
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
