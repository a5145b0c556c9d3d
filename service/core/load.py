"""What the batching knows of the server's load: how many requests are in progress, how many clients are
busy sending (a batch may wait for those)."""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.core.dataplane import Dataplane


class Total:
    """Several load hints as one: the sum of their sizes (the server's and each transport's)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Sized]):
        self.parts = parts

    def __len__(self) -> int:
        return sum(map(len, self.parts))


class InFlight:
    """The load hint of a server that gives none (plain uvicorn, a Ray replica, a test client): the
    requests in flight in this dataplane are those in progress, and their clients the busy ones. With
    two in flight and both queued there is nobody else to wait for (without a hint the first of a
    batch would wait ATTEND_MAX_BATCH_WAIT_US at least), and a request alone runs at once."""

    __slots__ = ("dataplane",)

    def __init__(self, dataplane: Dataplane):
        self.dataplane = dataplane

    def __len__(self) -> int:
        return self.dataplane.in_flight
