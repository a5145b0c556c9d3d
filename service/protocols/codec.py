"""What the codecs share: the contract (service.core.exchange.Codec, re-exported here) and media types.

    target   (model, version) from the route: a path's, or (None, None) where the body names them
    headers  the request's headers, lower-case names and raw values
    body     bytes, or a memoryview where the transport wrote it into one aligned buffer
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from service.core.exchange import Answer, Codec, Target

__all__ = ["JSON", "OCTETS", "Answer", "Codec", "Headers", "Target", "dumps", "media_type"]

Headers = dict[bytes, bytes]
JSON = b"application/json"
OCTETS = b"application/octet-stream"


def media_type(headers: Headers) -> str | None:
    raw = headers.get(b"content-type")
    if raw is None:
        return None
    if raw == JSON:  # what nearly every client sends
        return "application/json"
    return raw.decode("latin-1").split(";")[0].strip().lower()


_OPTION = orjson.OPT_SERIALIZE_NUMPY
# Numbers a call of orjson writes at most (about a millisecond's work): orjson holds the GIL for a whole call,
# so a thread writing a large answer lets the event loop have it between calls.
TEXT_AT_ONCE = 1 << 15


def json_parts(value: Any, numbers: int) -> bytes | list[Any]:
    """orjson.dumps(value) with NumPy arrays: those bytes where its arrays hold at most TEXT_AT_ONCE `numbers`
    in all; else the same bytes in parts, each from a call of orjson of at most TEXT_AT_ONCE numbers, not
    joined (a join copies the whole, its pages faulted in, with the GIL held). An HTTP body may be such a
    list (service.http.extensions.send_body)."""
    if numbers <= TEXT_AT_ONCE:
        return orjson.dumps(value, option=_OPTION)
    parts: list[Any] = []
    _parts(value, parts)
    return parts


def dumps(value: Any, numbers: int) -> bytes:
    """json_parts, joined."""
    parts = json_parts(value, numbers)
    return parts if parts.__class__ is bytes else b"".join(parts)  # type: ignore[arg-type]


def _parts(value: Any, parts: list[Any]) -> None:
    if value.__class__ is dict:
        separator = b"{"
        for key, item in value.items():
            parts.append(separator + orjson.dumps(key) + b":")
            separator = b","
            _parts(item, parts)
        parts.append(b"}" if value else b"{}")
    elif value.__class__ is list:
        parts.append(b"[")
        for i, item in enumerate(value):
            if i:
                parts.append(b",")
            _parts(item, parts)
        parts.append(b"]")
    elif isinstance(value, np.ndarray) and value.size > TEXT_AT_ONCE:
        item = value[0].size
        if item > TEXT_AT_ONCE:  # each row large itself: a row at a time
            _parts(list(value), parts)
            return
        step = TEXT_AT_ONCE // max(item, 1)
        parts.append(b"[")
        for i in range(0, len(value), step):
            if i:
                parts.append(b",")
            parts.append(memoryview(orjson.dumps(value[i:i + step], option=_OPTION))[1:-1])  # its rows, no brackets
        parts.append(b"]")
    else:
        parts.append(orjson.dumps(value, option=_OPTION))
