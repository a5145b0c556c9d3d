"""A compressed body (gzip, deflate) inflated a chunk at a time, bounded as it goes: never more than
ATTEND_MAX_BODY_BYTES out, never more than ATTEND_MAX_INFLATE_RATIO times the bytes in (a body that
inflates past it is refused as soon as it does, not once it is whole), and every chunk's bytes held in
the request's cost before the next one is made."""

from __future__ import annotations

import zlib

from service.core.cost import Cost
from service.core.errors import InvalidEncoding, PayloadTooLarge, UnsupportedMediaType, excerpt

_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
_CHUNK = 1 << 20
_RATIO_AFTER = 64 * 1024  # the ratio is judged once this much came out (tiny bodies compress oddly)


def encoding_of(header: bytes | None) -> str | None:
    """The body's Content-Encoding: None (not compressed), "gzip" or "deflate"; 415 for any other."""
    if header is None:
        return None
    name = header.decode("latin-1").strip().lower()
    if name in ("", "identity"):
        return None
    if name not in _WBITS:
        raise UnsupportedMediaType(f"Content-Encoding {excerpt(name)} is not supported; send gzip, deflate or none",
                                   field="Content-Encoding", expected="gzip, deflate or identity",
                                   received=name[:100])
    return name


class Inflater:
    """`run` inflates until done or until a number of bytes came out (the event loop does a bounded share,
    a decode thread the rest); `body` is the result. `held`: what the request holds besides (its
    compressed body), counted with what comes out in `cost`."""

    def __init__(self, data: bytes | memoryview, encoding: str, limit: int, max_ratio: float, cost: Cost,
                 held: int):
        self.data = data
        self.encoding = encoding
        self.limit = limit
        self.max_ratio = max_ratio
        self.cost = cost
        self.held = held
        self.inflater = zlib.decompressobj(wbits=_WBITS[encoding])
        self.tail: bytes | memoryview = data
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False

    def run(self, until: int | None = None) -> bool:
        """Inflate until done (True) or until `until` bytes came out in all (False)."""
        inflater, limit = self.inflater, self.limit
        while not self.done:
            if until is not None and self.size >= until:
                return False
            # Up to one byte past the limit: enough to know the body is over it.
            want = min(_CHUNK, limit + 1 - self.size)
            try:
                chunk = inflater.decompress(self.tail, want)
            except zlib.error as e:
                raise InvalidEncoding(f"the body is not valid {self.encoding} data: {e}", field="Content-Encoding") \
                    from None
            self.tail = inflater.unconsumed_tail
            self.size += len(chunk)
            if self.size > limit:
                raise PayloadTooLarge(f"the decompressed body is over the limit of {limit} bytes "
                                      "(ATTEND_MAX_BODY_BYTES)", expected=limit)
            consumed = len(self.data) - len(self.tail)
            if self.size > _RATIO_AFTER and self.size > self.max_ratio * max(consumed, 1):
                raise PayloadTooLarge(f"the body inflates more than {self.max_ratio:g} times "
                                      f"(ATTEND_MAX_INFLATE_RATIO): {self.size} bytes from {consumed}",
                                      field="Content-Encoding", expected=f"<= {self.max_ratio:g} times")
            if chunk:
                self.chunks.append(chunk)
                # The chunks, and their join to come: twice what came out.
                self.cost.hold(self.held + 2 * self.size, "the decompressed body")
            if inflater.eof:
                self.done = True
            elif not chunk and not self.tail:
                raise InvalidEncoding(f"the {self.encoding} body is truncated", field="Content-Encoding")
        return True

    def body(self) -> bytes:
        chunks, self.chunks = self.chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
