"""System shared memory, Triton's extension: a client on this host registers a region (a name for the
object /dev/shm/<key>, an offset into it and a size), then names it in place of an input's data, or as
where an output goes. Off unless ATTEND_SHARED_MEMORY=true; registering is an admin call where
ATTEND_ADMIN_KEYS is set (a region lets a client read and write an object of the server's /dev/shm).

The data moves by pread and pwrite on the object, never through a mapping of it: a client that shrinks
its object after registering gets a 400, where a mapping's read past the end would kill the process
(SIGBUS). With ATTEND_WORKERS > 1 the regions are a file the workers share (`file`), so a region
registered through one worker is there for the others.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.core.errors import ServiceError, excerpt

SHM_DIR = Path("/dev/shm")
MAX_REGIONS = 1024  # registered at once: each is a line of the shared file, opened per request
MAX_NAME = 256
# A key is one name in /dev/shm, as shm_open takes it (a leading slash, none after).
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,255}")


class SharedMemoryOff(ServiceError):
    """System shared memory is off: a client named a region, or called its register, status or unregister."""

    status, code = 404, "shared_memory_off"
    advice = ("Start the service with ATTEND_SHARED_MEMORY=true (for clients on its host), or send the tensors "
              "in the body.")


class RegionNotFound(ServiceError):
    """No system shared memory region of that name is registered."""

    status, code = 404, "region_not_found"
    advice = "GET /v2/systemsharedmemory/status lists the regions; register the region before naming it."


class InvalidRegion(ServiceError):
    """A shared memory region that cannot be registered or used as asked: its key, offset or size, or the
    object in /dev/shm (missing, not a file, smaller than the region)."""

    status, code = 400, "invalid_region"
    advice = ("Create the object (tritonclient.utils.shared_memory.create_shared_memory_region) before registering "
              "it, and keep it at least offset + byte_size bytes while it is registered.")


class Offload(Exception):  # noqa: N818 (not an error: a decode on the event loop hands itself to a thread)
    """Decoding this request on the event loop would read more of its shared memory than a decode there may
    (ATTEND_INLINE_DECODE_BYTES): decode it on a thread (service.core.exchange)."""


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int


class Regions:
    """The registered regions of this service (one process's, or all workers' through `file`)."""

    def __init__(self, file: Path | None = None, folder: Path = SHM_DIR):
        self.file = file
        self.folder = folder
        self._regions: dict[str, Region] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._changing = threading.Lock()  # the calls run on threads (service.http.routes.v2, service.grpc.server)

    # ---------------------------------------------------------------------- register, status, unregister

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name or len(name) > MAX_NAME:
            raise InvalidRegion(f"a region's name must be 1 to {MAX_NAME} characters, got {len(name)}")
        if not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise InvalidRegion(f"key must name one object of /dev/shm (letters, digits, '_', '-', '.'; one leading "
                                f"'/' at most), got {excerpt(key)}")
        if byte_size <= 0:
            raise InvalidRegion(f"byte_size must be positive, got {byte_size}")
        size = self._size(key)
        if offset + byte_size > size:
            raise InvalidRegion(f"region {excerpt(name)}: offset {offset} + byte_size {byte_size} is past the end "
                                f"of {excerpt(key)}, {size} bytes")
        region = Region(name, key, offset, byte_size)

        def add(regions: dict[str, Region]) -> None:
            if name in regions:
                raise InvalidRegion(f"a region named {excerpt(name)} is registered already: unregister it first")
            if len(regions) >= MAX_REGIONS:
                raise InvalidRegion(f"{MAX_REGIONS} regions are registered, the most at once: unregister one first")
            regions[name] = region

        self._change(add)

    def unregister(self, name: str = "") -> None:
        """The region `name` (none such: nothing to do, as Triton), or every region where `name` is empty."""
        self._change(lambda regions: regions.pop(name, None) if name else regions.clear())

    def status(self, name: str = "") -> list[dict[str, Any]]:
        regions = self._current()
        if name:
            return [asdict(self.get(name))]
        return [asdict(r) for r in regions.values()]

    def get(self, name: str) -> Region:
        region = self._current().get(name)
        if region is None:
            raise RegionNotFound(f"no system shared memory region {excerpt(name)} is registered")
        return region

    # ------------------------------------------------------------------------------------ the data

    def read(self, name: str, size: int, offset: int, dtype: np.dtype, what: str) -> np.ndarray:
        """`size` bytes at `offset` of the region, as a new flat array of `dtype` (`what`: whose, for errors)."""
        region, at = self._span(name, size, offset, what)
        array = np.empty(size // dtype.itemsize, dtype=dtype)
        into, got = memoryview(array).cast("B"), 0
        with self._open(region, os.O_RDONLY) as fd:
            while got < size:  # one read moves at most ~2 GiB; 0: the object ends there
                step = os.preadv(fd, [into[got:]], at + got)
                if not step:
                    break
                got += step
        if got != size:
            raise InvalidRegion(f"{what}: region {excerpt(name)} has {got} of its {size} bytes at offset {offset}: "
                                f"its object {excerpt(region.key)} shrank since it was registered")
        return array

    def target(self, name: str, size: int, offset: int, needed: int, what: str) -> OutputRegion:
        """Where an output of `needed` bytes goes: `size` bytes at `offset` of the region (InvalidRegion
        where they cannot hold it)."""
        region, at = self._span(name, size, offset, what)
        if needed > size:
            raise InvalidRegion(f"{what}: shared_memory_byte_size is {size} bytes, the output takes {needed}")
        return OutputRegion(region, at, needed, self.folder)

    # --------------------------------------------------------------------------------- the store

    def _span(self, name: str, size: int, offset: int, what: str) -> tuple[Region, int]:
        region = self.get(name)
        if size < 0 or offset < 0 or offset + size > region.byte_size:
            raise InvalidRegion(f"{what}: offset {offset} + shared_memory_byte_size {size} is past the end of region "
                                f"{excerpt(name)}, {region.byte_size} bytes")
        return region, region.offset + offset

    def _path(self, key: str) -> Path:
        return self.folder / key.lstrip("/")

    def _size(self, key: str) -> int:
        with _Fd(self._path(key), os.O_RDONLY, Region("", key, 0, 0)) as fd:
            return os.fstat(fd).st_size

    def _open(self, region: Region, flags: int) -> _Fd:
        return _Fd(self._path(region.key), flags, region)

    def parsed(self) -> bool:
        """No change to the shared file left to parse (always, without one): what a decode on the event loop
        may go on with. Parsing up to MAX_REGIONS regions is a decode thread's work."""
        stamp = self._file_stamp()
        return stamp is None or stamp == self._stamp  # None: no file, none registered: nothing to parse

    def _file_stamp(self) -> tuple[int, int, int] | None:
        """The shared file's (inode, mtime, size): a change rewrites it (os.replace). None: no file."""
        if self.file is None:
            return None
        try:
            info = os.stat(self.file)
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def _current(self) -> dict[str, Region]:
        """The regions, read again from the shared file where another worker changed it."""
        if self.file is None:
            return self._regions
        stamp = self._file_stamp()
        if stamp is None:
            self._regions, self._stamp = {}, None
            return self._regions
        if stamp != self._stamp:
            self._regions = {r["name"]: Region(**r) for r in json.loads(self.file.read_bytes())}
            self._stamp = stamp
        return self._regions

    def _change(self, change: Any) -> None:
        with self._changing:
            self._change_locked(change)

    def _change_locked(self, change: Any) -> None:
        if self.file is None:
            change(self._regions)
            return
        with open(self.file.with_suffix(".lock"), "a") as lock:  # two workers at once: both changes kept
            fcntl.flock(lock, fcntl.LOCK_EX)
            regions = dict(self._current())
            change(regions)
            with tempfile.NamedTemporaryFile("w", dir=self.file.parent, delete=False) as out:
                json.dump([asdict(r) for r in regions.values()], out)
            os.replace(out.name, self.file)
            self._regions, self._stamp = regions, None


class _Fd:
    """The region's object, open for one read or write: a missing one, a link, or one that is not a file (a
    FIFO would block the open, a device read forever) is InvalidRegion."""

    def __init__(self, path: Path, flags: int, region: Region):
        whose = f"region {excerpt(region.name)}: " if region.name else ""
        try:
            self.fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise InvalidRegion(f"{whose}cannot open {excerpt(region.key)} in /dev/shm: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise InvalidRegion(f"{whose}{excerpt(region.key)} in /dev/shm is not a shared memory object")

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


class OutputRegion:
    """An output's place in a region, checked when the request is decoded: `write` after the run."""

    __slots__ = ("region", "at", "size", "path")

    def __init__(self, region: Region, at: int, size: int, folder: Path):
        self.region, self.at, self.size = region, at, size
        self.path = folder / region.key.lstrip("/")

    def write(self, array: np.ndarray) -> ServiceError | None:
        """The output written (on the run's thread); an error for this request alone where it cannot be,
        which its batch does not share."""
        data = memoryview(np.ascontiguousarray(array, dtype="<f4")).cast("B")
        written = 0
        try:
            with _Fd(self.path, os.O_WRONLY, self.region) as fd:
                while written < len(data):  # one write moves at most ~2 GiB
                    step = os.pwrite(fd, data[written:], self.at + written)
                    if not step:
                        break
                    written += step
        except InvalidRegion as e:
            return e
        except OSError as e:
            return InvalidRegion(f"region {excerpt(self.region.name)}: the output could not be written: {e.strerror}")
        if written != len(data):
            return InvalidRegion(f"region {excerpt(self.region.name)}: {written} of the output's {len(data)} bytes "
                                 "were written")
        return None
