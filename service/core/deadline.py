"""A request's deadline over a block of awaits: its task cancelled when the deadline passes, and that
cancellation (not another's) raised as DeadlineExceeded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from service.core.errors import DeadlineExceeded

# The deadline of the request a decode thread works on (Dataplane.in_thread sets `until`): a decode that waits
# on another process waits no longer.
on_thread = threading.local()


class Within:
    """`Dataplane.within`: cancels the task at `until`, and turns that cancellation (not another's)
    into DeadlineExceeded. (The timer can fire only while the task waits at an await in the block,
    so the cancellation is always delivered there, inside it.)"""

    __slots__ = ("task", "timer", "passed", "what")

    def __init__(self, loop: asyncio.AbstractEventLoop, until: float, what: str):
        self.task = asyncio.current_task(loop)
        self.passed = False
        self.what = what
        self.timer = loop.call_later(max(until - time.monotonic(), 0), self._expire)

    def _expire(self) -> None:
        self.passed = True
        self.task.cancel()  # type: ignore[union-attr]

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.timer.cancel()
        # Not the clock: the loop's timers run up to a millisecond early (libuv's clock counts
        # milliseconds). Another's cancellation (the server stopping) is theirs to handle.
        if self.passed and kind is asyncio.CancelledError:
            self.task.uncancel()  # type: ignore[union-attr]
            raise DeadlineExceeded(f"the request's deadline passed before {self.what}") from None
