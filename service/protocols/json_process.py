"""Large JSON bodies parsed in processes of their own. simdjson's parse and the arrays' reading hold the GIL for
as long as they take (a 24 MiB body: 60-270 ms), and the event loop waits all that time (docs/reliability.md).
Here a decode thread writes the body into a memfd (a system call: the GIL is free), a child process parses it
with the reader its protocol sends (a function of the body and a parser) and writes the answer into a memfd of its
own, its arrays out of band (pickle protocol 5), which the thread maps: the arrays are neither parsed nor copied
under the service's GIL.

A reader reads only what needs no model: /attend's top-level fields (`read_fields`), an inference request's head
(service.protocols.v2.read_head). The thread checks the rest as it would a parse of its own, so every answer and
error is the one a decode thread gives. A child that dies or answers garbage is replaced, and its request decoded
on the thread; so is one whose reader fails, but that child is kept.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import simdjson

from service.core.errors import DeadlineExceeded, ServiceError
from service.core.memory import aligned, trim_memory
from service.protocols.json_arrays import Read, fast_array, parse

log = logging.getLogger("service")

_SIZE = struct.Struct("<QQ")  # a body's size (and 0); a reply's: where its index starts, and its length
_ROOT = str(Path(__file__).resolve().parents[2])
_IDLE_S = 2.0  # a child without a body for this long frees its parser and trims its heap
_LONGEST_S = 60.0  # a parse's wait where no request deadline is known (the child's parse is linear in the body)
_READY = b"ready"  # a child's first message, once its imports are done


class NotStarted(RuntimeError):
    """A decode process did not start (the message says so in one line)."""


class Raised(NamedTuple):
    """An error a reader met, in place of its value: the thread raises it where it reaches that value (so errors
    come in the order a thread's own parse meets them). Its class and fields: an error's own pickle would call
    its __init__ with the wrong arguments."""

    kind: type
    fields: dict[str, Any]

    @classmethod
    def of(cls, error: ServiceError) -> Raised:
        return cls(type(error), dict(error.__dict__))

    def error(self) -> ServiceError:
        error = self.kind.__new__(self.kind)
        Exception.__init__(error, self.fields["message"])
        error.__dict__.update(self.fields)
        return error


class Failed(NamedTuple):
    """A reader's own fault (an exception not a ServiceError), by its class's name: the child lives on, the
    thread decodes the body itself (the same fault there is its 500, as without processes)."""

    kind: str


def given(value: Any) -> Any:
    """`value`, or the error a reader put in its place, raised."""
    if value.__class__ is Raised:
        raise value.error()
    return value


Reader = Callable[[Any, simdjson.Parser], Any]  # a module's function (pickled by name), or a partial of one


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

    def parse(self, body: Any, read: Reader, until: float) -> Any:
        self.wait_started(until)
        size = len(body)
        fd = os.memfd_create("attend-body", os.MFD_CLOEXEC)
        try:
            view, written = memoryview(body).cast("B"), 0
            while written < size:  # os.write frees the GIL: the page faults of the copy happen without it
                written += os.write(fd, view[written:])
            self.socket.settimeout(max(until - time.monotonic(), 0.001))
            socket.send_fds(self.socket, [_SIZE.pack(size, 0) + pickle.dumps(read)], [fd])
        finally:
            os.close(fd)
        message, fds, _, _ = socket.recv_fds(self.socket, 1024, 1)
        if len(message) != _SIZE.size or len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise EOFError("the decode process answered nothing, or garbage")
        offset, length = _SIZE.unpack(message)
        try:
            # Not MAP_POPULATE: Python 3.11's mmap call holds the GIL (3.12 frees it), 2-4 ms for 24 MiB of pages;
            # their faults come later in NumPy's and ONNX Runtime's loops, which free it.
            mapped = mmap.mmap(fds[0], offset + length, flags=mmap.MAP_SHARED)
        finally:
            os.close(fds[0])
        places, text = pickle.loads(mapped[offset:offset + length])
        whole = memoryview(mapped)
        return given(pickle.loads(text, buffers=[whole[at:at + size] for at, size in places]))  # arrays: views

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

    def parse(self, body: Any, read: Reader, until: float | None) -> Any:
        """`read(body, parser)`, run in a decode process: its arrays map the process's memory. Raises what `read`
        raises (a ServiceError), and DeadlineExceeded at `until` (a child still parsing then is replaced). None
        where the child failed: the caller parses the body itself."""
        until = time.monotonic() + _LONGEST_S if until is None else until
        try:
            child = self._idle.get(timeout=max(until - time.monotonic(), 0))
        except queue.Empty:
            raise DeadlineExceeded("the request's deadline passed before its body could be decoded") from None
        try:
            data = child.parse(body, read, until)
            if data.__class__ is Failed:
                log.warning("a JSON decode process's reader raised %s; the body is decoded on the thread", data.kind)
                data = None
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


def read_fields(body: Any, parser: simdjson.Parser, fields: frozenset[str], arrays_in: dict[str, str]
                ) -> dict[str, Any]:
    """/attend's reader: the body's top-level object (`fields`: the keys it may have). The fields in `arrays_in`
    `Read` where the fast way reads them, cast to the dtype given there (as the service would: float32's overflow
    to inf is refused there), empty lists where not; objects empty; other values as sent."""
    data = parse(body, fields, parser)
    for key, value in data.items():
        fast = fast_array(value) if key in arrays_in else None
        data[key] = stand_in(value) if fast is None else Read(fast[0].astype(arrays_in[key], copy=False), fast[1])
    return data


def stand_in(value: Any) -> Any:
    """A value a reader does not read, for the thread: simdjson's containers empty (the thread names only their
    type: json_type's "an array", "an object"), other values as they are."""
    return [] if value.__class__ is simdjson.Array else {} if value.__class__ is simdjson.Object else value


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
        read = pickle.loads(message[_SIZE.size:])
        with mmap.mmap(fds[0], size, prot=mmap.PROT_READ) as body:
            os.close(fds[0])
            try:
                answer = read(body, parser)
            except ServiceError as e:
                answer = Raised.of(e)
            except Exception as e:  # a bug that a body finds: one body's, not the process's end
                answer = Failed(type(e).__name__)
            buffers: list[pickle.PickleBuffer] = []
            text = pickle.dumps(answer, protocol=5, buffer_callback=buffers.append)
            del answer
        places, end = [], 0
        for buffer in buffers:
            places.append((end, buffer.raw().nbytes))
            end = aligned(end + places[-1][1])
        index = pickle.dumps((places, text))
        fd = os.memfd_create("attend-arrays", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, end + len(index))
            with mmap.mmap(fd, end + len(index)) as out:
                for (at, length), buffer in zip(places, buffers, strict=True):
                    out[at:at + length] = buffer.raw()
                out[end:] = index
            del buffers
            socket.send_fds(sock, [_SIZE.pack(end, len(index))], [fd])
        finally:
            os.close(fd)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server says when to go: it closes the socket
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.send(_READY)
    _serve(sock)


if __name__ == "__main__":  # by its name: what it pickles (Raised) must unpickle in the server
    from service.protocols.json_process import main as named

    named()
