"""The connection guard's state for one process: the limits, the connections it watches, one sweep of
their header and body deadlines, and the connections busy lately (the batching's load hint)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from service.config import Settings, get_settings
from service.core.metrics import Metrics

if TYPE_CHECKING:
    from service.http.accept import Shares
    from service.http.protocol import GuardedProtocol


_SWEEP_S = 0.25  # how often the header and body deadlines are looked at


class BusyConnections:
    """The connections that began a request in the last `window_s`: the clients a batch can expect
    more requests from (an idle keep-alive connection is not one). `len()` counts them; each
    request's start is O(1), expired entries go as new ones come."""

    def __init__(self, window_s: float = 0.02):
        self.window_s = window_s
        self._last: dict[Any, float] = {}  # connection (a key for it) -> when its latest request began
        self._starts: deque[tuple[float, Any]] = deque()

    def touch(self, connection: Any, now: float) -> None:
        self._last[connection] = now
        self._starts.append((now, connection))
        self._expire(now)

    def _expire(self, now: float) -> None:
        horizon, starts, last = now - self.window_s, self._starts, self._last
        while starts and starts[0][0] < horizon:
            when, connection = starts.popleft()
            if last.get(connection) == when:
                del last[connection]

    def __len__(self) -> int:
        self._expire(time.monotonic())
        return len(self._last)


class Guard:
    """The limits, and what the connections of one process hold against them. One sweep every
    `_SWEEP_S` looks at every connection's header and body deadlines (a timer per request cost
    ~30% more CPU a request on a trivial app: bench/guard_cost.py)."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None):
        self.settings = settings
        # Each reason's counter (attend_refused_total), where the server gave the app's metrics.
        self.refusals = metrics.refusals if metrics is not None else {}
        self.protocols: set[GuardedProtocol] = set()
        self.busy = BusyConnections()
        self.shares: Shares | None = None  # where a worker of several tells the others how many it holds
        self._sweeping: asyncio.TimerHandle | None = None

    def add(self, protocol: GuardedProtocol) -> None:
        self.protocols.add(protocol)
        if self.shares is not None:
            self.shares.set(len(self.protocols))
        if self._sweeping is None:
            self._sweeping = protocol.loop.call_later(_SWEEP_S, self._sweep, protocol.loop)

    def remove(self, protocol: GuardedProtocol) -> None:
        self.protocols.discard(protocol)
        if self.shares is not None:
            self.shares.set(len(self.protocols))

    def refused(self, reason: str) -> None:
        counter = self.refusals.get(reason)
        if counter is not None:
            counter.inc()

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for protocol in list(self.protocols):
            protocol.check_deadlines(now)
        self._sweeping = loop.call_later(_SWEEP_S, self._sweep, loop) if self.protocols else None


_guard: Guard | None = None


def guard() -> Guard:
    """The guard of a protocol that no GracefulServer gave one (uvicorn run otherwise, with this
    protocol class): from the environment's settings."""
    global _guard
    if _guard is None:
        _guard = Guard(get_settings())
    return _guard
