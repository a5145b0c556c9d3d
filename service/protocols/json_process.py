"""Large JSON bodies parsed in processes of their own. simdjson's parse and the arrays' reading hold the GIL for
as long as they take (a 24 MiB body: 60-270 ms), and the event loop waits all that time (docs/reliability.md).
Here a decode thread writes the body into a memfd (a system call: the GIL is free), a child process parses it
(service.protocols.json_arrays, as the thread would have) and writes the arrays into a memfd of its own, which
the thread maps: the arrays are neither parsed nor copied under the service's GIL.

The child reads only what needs no model: the top-level object, and each array field's numbers where the fast
path reads them. The caller checks the rest (service.protocols.attend), so every answer and error is the one a
decode thread gives. A child that dies or errs is replaced, and its request decoded on the thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import simdjson

from service.core.errors import DeadlineExceeded, ServiceError
from service.core.memory import aligned, trim_memory
from service.protocols.json_arrays import Read, fast_array, parse

log = logging.getLogger("service")

_SIZE = struct.Struct("<QQ")  # a body's size (and 0); a reply's: where its pickle starts, and its length
_ROOT = str(Path(__file__).resolve().parents[2])
_IDLE_S = 2.0  # a child without a body for this long frees its parser and trims its heap
_LONGEST_S = 60.0  # a parse's wait where no request deadline is known (the child's parse is linear in the body)
_READY = b"ready"  # a child's first message, once its imports are done


class NotStarted(RuntimeError):
    """A decode process did not start (the message says so in one line)."""


class _Child:
    __slots__ = ("process", "socket", "started")

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own session: a terminal's Ctrl-C reaches the server, which closes the socket (the child's cue).
        # The service's root first on its path: it imports this module whatever the server's directory.
        path = os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=os.environ | {"PYTHONPATH": path})
        theirs.close()
        self.socket = ours
        self.started = False

    def wait_started(self, until: float) -> None:
        """Until the child says it is ready (its imports take a few hundred ms)."""
        if not self.started:
            self.socket.settimeout(max(until - time.monotonic(), 0.001))
            if self.socket.recv(16) != _READY:
                raise EOFError(f"exit {self.process.wait()}")
            self.started = True

    def parse(self, body: Any, fields: tuple[frozenset[str], dict[str, str]], until: float) -> dict[str, Any]:
        self.wait_started(until)
        size = len(body)
        fd = os.memfd_create("attend-body", os.MFD_CLOEXEC)
        try:
            view, written = memoryview(body).cast("B"), 0
            while written < size:  # os.write frees the GIL: the page faults of the copy happen without it
                written += os.write(fd, view[written:])
            self.socket.settimeout(max(until - time.monotonic(), 0.001))
            socket.send_fds(self.socket, [_SIZE.pack(size, 0) + pickle.dumps(fields)], [fd])
        finally:
            os.close(fd)
        message, fds, _, _ = socket.recv_fds(self.socket, 1024, 1)
        if len(message) != _SIZE.size or len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise EOFError("the decode process answered nothing, or garbage")
        offset, length = _SIZE.unpack(message)
        try:
            # MAP_POPULATE: its pages mapped in the mmap call, which frees the GIL, not faulted in later under it.
            mapped = mmap.mmap(fds[0], offset + length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fds[0])
        reply = pickle.loads(mapped[offset:offset + length])
        if isinstance(reply, tuple):  # an error: its class, its fields
            kind, fields_of = reply
            error = kind.__new__(kind)
            Exception.__init__(error, fields_of["message"])
            error.__dict__.update(fields_of)
            raise error
        for key, value in reply.items():
            if value.__class__ is tuple:  # an array read: (offset, dtype, shape, brackets)
                start, dtype, shape, brackets = value
                array = np.frombuffer(mapped, dtype, int(np.prod(shape)), start).reshape(shape)
                reply[key] = Read(array, brackets)
        return reply

    def stop(self) -> None:
        self.socket.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class JsonProcesses:
    """A few decode processes (each parses one body at a time), and the thread-side call that uses them."""

    def __init__(self, count: int):
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children = [_Child() for _ in range(count)]
        try:  # a broken install says so at the start, not at the first large body
            for child in self._children:
                child.wait_started(time.monotonic() + _LONGEST_S)
        except (OSError, EOFError) as e:
            self.close()
            raise NotStarted(f"a JSON decode process did not start ({e}; its error is above): large JSON bodies "
                             "are parsed on the decode threads") from None
        for child in self._children:
            self._idle.put(child)
        self.replaced = 0
        self.closed = False

    def parse(self, body: Any, fields: tuple[frozenset[str], dict[str, str]], until: float | None
              ) -> dict[str, Any] | None:
        """The body's top-level object, `fields` being (the keys it may have, the dtype of each array): its
        arrays `Read` where the fast way reads them, empty lists where not; objects empty; other values as
        sent. Raises InvalidJSON, and DeadlineExceeded at `until` (a child still parsing then is replaced).
        None where the child failed: the caller parses the body itself."""
        until = time.monotonic() + _LONGEST_S if until is None else until
        try:
            child = self._idle.get(timeout=max(until - time.monotonic(), 0))
        except queue.Empty:
            raise DeadlineExceeded("the request's deadline passed before its body could be decoded") from None
        try:
            data = child.parse(body, fields, until)
        except ServiceError:
            self._idle.put(child)
            raise
        except TimeoutError:
            self._replace(child, "ran past a request's deadline")
            raise DeadlineExceeded("the request's deadline passed before its body was decoded") from None
        except Exception as e:  # it died, or said nothing that makes sense
            try:  # its socket closes as it exits: its exit code comes a moment later
                why = f"failed ({type(e).__name__}, exit {child.process.wait(1)})"
            except subprocess.TimeoutExpired:
                why = f"failed ({type(e).__name__})"
            self._replace(child, why)
            return None
        self._idle.put(child)
        return data

    def _replace(self, child: _Child, why: str) -> None:
        child.stop()
        if self.closed:  # the server is stopping: a decode still under way when it did
            return
        log.warning("a JSON decode process %s; starting another", why)
        fresh = _Child()
        self._children[self._children.index(child)] = fresh
        self.replaced += 1
        self._idle.put(fresh)

    def pids(self) -> list[int]:
        return [child.process.pid for child in self._children]

    def close(self) -> None:
        self.closed = True
        for child in self._children:
            child.stop()


# ----------------------------------------------------------------------------------------------- the child


def _reply(body: Any, fields: frozenset[str], arrays_in: dict[str, str], parser: simdjson.Parser
           ) -> tuple[list[tuple[int, np.ndarray]], Any]:
    """The arrays to write (where each starts), and what says where they are (or an error: its class, its fields).
    `arrays_in`: the fields read as arrays, and the dtype each is cast to (as the service would: float32's
    overflow to inf is refused there)."""
    try:
        data = parse(body, fields, parser)
    except ServiceError as e:
        return [], (type(e), dict(e.__dict__))
    arrays, reply, at = [], {}, 0
    for key, value in data.items():
        if value.__class__ is simdjson.Array:
            fast = fast_array(value) if key in arrays_in else None
            if fast is None:
                reply[key] = []  # the caller names the field; json_type says "an array"
                continue
            array, brackets = fast[0].astype(arrays_in[key], copy=False), fast[1]
            arrays.append((at, array))
            reply[key] = (at, array.dtype.str, array.shape, brackets)
            at += aligned(array.nbytes)
        elif value.__class__ is simdjson.Object:
            reply[key] = {}
        else:
            reply[key] = value
    return arrays, reply


def _serve(sock: socket.socket) -> None:
    parser = None
    while True:
        # One parser from body to body (a fresh one allocates and faults in buffers as large as the body each
        # time: a third of a 2 MiB body's parse); when idle, none, and the heap trimmed.
        sock.settimeout(None if parser is None else _IDLE_S)
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        except TimeoutError:
            parser = None
            trim_memory()
            continue
        if not message:
            return  # the server closed its end
        parser = parser or simdjson.Parser()
        size = _SIZE.unpack_from(message)[0]
        fields, arrays_in = pickle.loads(message[_SIZE.size:])
        with mmap.mmap(fds[0], size, prot=mmap.PROT_READ) as body:
            os.close(fds[0])
            arrays, reply = _reply(body, fields, arrays_in, parser)
        text = pickle.dumps(reply)
        offset = aligned(arrays[-1][0] + arrays[-1][1].nbytes) if arrays else 0
        fd = os.memfd_create("attend-arrays", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, offset + len(text))
            with mmap.mmap(fd, offset + len(text)) as out:
                for at, array in arrays:
                    np.frombuffer(out, array.dtype, array.size, at)[...] = array.ravel()
                out[offset:] = text
            del arrays, reply
            socket.send_fds(sock, [_SIZE.pack(offset, len(text))], [fd])
        finally:
            os.close(fd)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server says when to go: it closes the socket
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.send(_READY)
    _serve(sock)


if __name__ == "__main__":
    main()
