"""SIGTERM for gRPC: answer the calls under way, let their bytes reach the clients, then stop grpc.

grpc's own stop sends GOAWAY and closes each connection as soon as its last call is written to the kernel.
An answer still in the send queue then (a client slower to read than the server to write) is lost: the
client's next frame, a WINDOW_UPDATE for the answer's first part, meets a closed socket, and the kernel
resets the connection, dropping what it had not sent (test_grpc's slow relay: every time). So the guard
refuses new calls first, and grpc stops once the calls are answered and their bytes acknowledged. A call
counts until grpc has handed its answer to the transport (its done callback), not until its handler
returns: grpc serializes and writes the answer after that.
"""

from __future__ import annotations

import asyncio
import os
import sys

from service.grpc.guard import CallGuard

_POLL_S = 0.01


async def drain(guard: CallGuard, port: int, grace_s: float) -> float:
    """Refuse new calls, wait (within `grace_s`) for those under way and for the acknowledgement of what
    this process sent from `port`; return the grace left for grpc's own stop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    guard.stop()
    while guard.unfinished and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)
    quiet = 0  # polls in a row with nothing unacknowledged: two, so that a write under way is seen
    while quiet < 2 and loop.time() < deadline:
        quiet = 0 if unacknowledged(port) else quiet + 1
        await asyncio.sleep(_POLL_S)
    return max(0.0, deadline - loop.time())


def unacknowledged(port: int) -> int:
    """Bytes this process wrote to its TCP connections on local `port` that the peers have not acknowledged
    yet (Linux: /proc/net/tcp's tx_queue; elsewhere 0: nothing to wait for)."""
    if sys.platform != "linux":
        return 0
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    # sl local rem st tx_queue:rx_queue tr:when retrnsmt uid timeout inode ...
                    fields = row.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                        total += int(fields[4].split(":")[0], 16)
        except OSError:
            continue
    return total
