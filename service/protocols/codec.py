"""What the codecs share: the contract (service.core.exchange.Codec, re-exported here) and media types.

    target   (model, version) from the route: a path's, or (None, None) where the body names them
    headers  the request's headers, lower-case names and raw values
    body     bytes, or a memoryview where the transport wrote it into one aligned buffer
"""

from __future__ import annotations

from service.core.exchange import Answer, Codec, Target

__all__ = ["JSON", "OCTETS", "Answer", "Codec", "Headers", "Target", "media_type"]

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
