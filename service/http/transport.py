"""Two ways the service's HTTP protocol spares a request copies and system calls: a response's head and
body (or its parts) in one write (`CoalescingTransport`, the "attend.hold" extension), and a body written
once into one aligned buffer as it arrives (`BodySink`, the "attend.body" extension)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from service.core.memory import ALIGN


class CoalescingTransport:
    """uvicorn writes a response's status line and headers, then its body, with a write each: two
    send() system calls and two TCP segments for every small response. An endpoint that sends both
    at once (service.http.endpoint.send_body) calls `hold_next` first (offered to it in the
    request's scope as the "attend.hold" extension): the head is held, and goes out joined with the
    body in one write. A body sent in parts (a binary response's JSON header, then each tensor's
    bytes, never joined) is held the same way, part by part, and goes out in one `writelines` (one
    writev() under uvloop, nothing copied). Everything else is the real transport's; closing flushes
    what is held."""

    __slots__ = ("transport", "held", "holding", "closing")

    def __init__(self, transport: asyncio.Transport, closing: Any = None):
        self.transport = transport
        self.held: list[Any] | None = None
        self.holding = 0
        self.closing = closing  # the protocol's say on a close: True defers it (a drain first)

    def hold_next(self, writes: int = 1) -> None:
        """Hold the next `writes` writes; the one after them takes them along."""
        self.holding = writes

    def write(self, data: Any) -> None:
        if self.holding:
            self.holding -= 1
            if self.held is None:
                self.held = [data]
            else:
                self.held.append(data)
            return
        held = self.held
        if held is None:
            self.transport.write(data)
            return
        self.held = None
        if len(held) == 1 and len(data) <= 64 * 1024:
            self.transport.write(held[0] + data)
        else:  # large, or in parts: not copied to join them
            held.append(data)
            self.transport.writelines(held)

    def flush(self) -> None:
        held, self.held, self.holding = self.held, None, 0
        if held is not None:
            self.transport.writelines(held)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self, now: bool = False) -> None:
        self.flush()
        if not now and self.closing is not None and self.closing():
            return
        self.transport.close()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)




class BodySink:
    """A request's body, written into one buffer of its Content-Length as it arrives. uvicorn
    appends each chunk to a bytearray, stops reading past 64 KiB until the app takes it, hands it
    over as bytes (a copy each time), and the app joins the pieces (another): for a large body
    that is three copies and a wake-up of the app every 64 KiB. Here each chunk is copied once and
    the app wakes once, when the body is complete. The buffer is placed so that the byte at
    `aligned_at` is 64-byte aligned: the binary tensors after an inference request's JSON header
    are then read in place (ONNX Runtime wants aligned data; a misaligned one is copied)."""

    __slots__ = ("view", "filled", "done")

    def __init__(self, size: int, aligned_at: int, done: asyncio.Future):
        raw = np.empty(size + ALIGN, dtype=np.uint8)
        start = -(raw.ctypes.data + aligned_at) % ALIGN
        self.view = memoryview(raw[start:start + size])
        self.filled = 0
        self.done = done

    def write(self, chunk: Any) -> None:
        end = self.filled + len(chunk)
        self.view[self.filled:end] = chunk
        self.filled = end

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(self.view[:self.filled])
