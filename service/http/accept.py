"""Even connections over the workers of ATTEND_WORKERS. On one shared listening socket the kernel wakes
every idle worker for a connection, the first to run takes it, and uvloop then accepts until the queue is
empty: 16 connections opened at once all went to one of two workers (tests/service/test_accept.py), and
on the lent GPU host a worker of 8 served none (docs/benchmarks.md). Here a worker accepts only while it
holds at most the workers' mean + 1 connections (their counts in shared memory); over its share, it takes a
connection anyway once it has waited `_PATIENCE_S`, so that a busy or stuck worker never holds one back."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import socket
from collections.abc import Callable

log = logging.getLogger("service")

_RETRY_S = 0.001  # a worker over its share looks again this much later
_PATIENCE_S = 0.02  # and accepts anyway once a connection has waited this long


class Shares:
    """Each worker's slot (its pid, its open connections) in memory the supervisor shares with them all."""

    def __init__(self, workers: int):
        context = multiprocessing.get_context("spawn")
        self._lock = context.Lock()
        self._slots = context.RawArray(ctypes.c_long, 2 * workers)  # pid, connections; pid 0: free
        self._mine = -1

    def claim(self) -> bool:
        """This process takes a free slot, or one whose process is gone (the worker it replaces)."""
        # With a timeout: a worker killed while it held the lock would leave it held.
        if not self._lock.acquire(timeout=1.0):
            return False
        try:
            for i in range(0, len(self._slots), 2):
                if self._slots[i] == 0 or not _alive(self._slots[i]):
                    self._slots[i], self._slots[i + 1], self._mine = os.getpid(), 0, i
                    return True
            return False
        finally:
            self._lock.release()

    def release(self, pid: int) -> None:
        """The supervisor's, for a worker that ended: its slot is free, and its count no longer in the mean."""
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            for i in range(0, len(self._slots), 2):
                if self._slots[i] == pid:
                    self._slots[i + 1], self._slots[i] = 0, 0
        finally:
            self._lock.release()

    def set(self, connections: int) -> None:
        self._slots[self._mine + 1] = connections

    def over(self, connections: int) -> bool:
        """This worker's count set to `connections`: whether it is more than the workers' mean + 1."""
        slots = self._slots
        slots[self._mine + 1] = connections
        counts = [slots[i + 1] for i in range(0, len(slots), 2) if slots[i]]
        return connections * len(counts) > sum(counts) + len(counts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # none, or another user's that took the pid: not our worker
        return False
    return True


class BalancedListener:
    """One worker's accepting on a shared listening socket, in place of uvloop's server (its `sockets`,
    `close` and `wait_closed`, as uvicorn and GracefulServer use them)."""

    def __init__(self, sock: socket.socket, protocol: Callable[[], asyncio.Protocol], shares: Shares,
                 connections: Callable[[], int], backlog: int):
        self.sockets = [sock]
        self._sock, self._protocol, self._shares, self._connections = sock, protocol, shares, connections
        self._loop = asyncio.get_running_loop()
        self._waiting_since: float | None = None  # when this worker, over its share, began to wait
        self._last_look = 0.0
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        sock.listen(backlog)  # uvicorn's supervisor binds it; the server of each worker listens
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._ready)

    def _ready(self) -> None:
        now = self._loop.time()
        # Every idle worker wakes for a connection: each writes its count as it decides.
        mine = self._connections() + len(self._tasks)
        if self._shares.over(mine):
            # Waiting since the first look of a run of them (a look long after the last: the queue was emptied
            # by another worker in between, and this is a new connection).
            if self._waiting_since is None or now - self._last_look > _PATIENCE_S:
                self._waiting_since = now
            self._last_look = now
            if now - self._waiting_since < _PATIENCE_S:
                self._loop.remove_reader(self._sock.fileno())
                self._retry = self._loop.call_later(_RETRY_S, self._resume)
                return
        self._waiting_since = None
        try:
            connection, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):  # another worker took it
            return
        except OSError as e:  # out of file descriptors, say: the connection waits in the queue
            log.warning("accept failed: %s", e.strerror)
            self._loop.remove_reader(self._sock.fileno())
            self._retry = self._loop.call_later(0.1, self._resume)
            return
        self._shares.set(mine + 1)
        connection.setblocking(False)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._loop.connect_accepted_socket(self._protocol, connection))
        self._tasks.add(task)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the client went before: nothing to serve
            log.debug("connection not made: %r", task.exception())

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    async def wait_closed(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

