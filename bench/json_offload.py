"""What a large JSON body's decode holds the GIL for, and what a decode process would free: the service's decode
(service.protocols.attend.decode_body: simdjson's parse and its arrays, which hold the GIL) on a thread, as the
service runs it today, against the same decode in a child process, the body in shared memory (/dev/shm, as a
body sink could write it while it arrives) and the arrays mapped back. Per form of body (tests/load/bodies.py), the
longest a thread ticking beside it waited for the GIL (the event loop's wait) and the decode's time, medians
over rounds. A measurement for a design not built (docs/reliability.md, the event loop and the GIL).

    python bench/json_offload.py [--mib 24] [--rounds 3] [--repository model_repository]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compute import cpu  # noqa: E402

from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import decode_body  # noqa: E402
from tests.load.bodies import json_dense, json_long  # noqa: E402
from tests.load.gil import longest_wait  # noqa: E402

FORMS = {"long decimals": json_long, "dense": json_dense}
_registry: Registry | None = None  # loaded before the child is forked: it inherits it


def _child(conn) -> None:
    """Decodes each body named (a file in /dev/shm and its size) into arrays in files of their own."""
    while (named := conn.recv()) is not None:
        body = np.memmap(named[0], np.uint8, "r", shape=(named[1],))
        request = decode_body(body.tobytes(), _registry)
        arrays = {}
        for i, (name, array) in enumerate(request.feed.items()):
            path = f"{named[0]}.{i}"
            np.memmap(path, array.dtype, "w+", shape=array.shape)[...] = array
            arrays[name] = (path, array.dtype.str, array.shape)
        conn.send(arrays)


def _in_child(conn, path: str, size: int) -> list[np.ndarray]:
    conn.send((path, size))
    arrays = [np.memmap(path, dtype, "r", shape=shape) for path, dtype, shape in conn.recv().values()]  # mapped
    for array in arrays:
        os.unlink(array.filename)
    return arrays


def _timed(work) -> tuple[float, float, object]:
    """(the longest a thread beside `work` waited for the GIL, its time) in ms, and its result."""
    waited, took, result = longest_wait(work)
    return waited * 1e3, took * 1e3, result


def main() -> int:
    global _registry
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=24.0, help="each body's size, MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the service's (service.core.dataplane)
    _registry = Registry.load(args.repository, "cpu", 1)
    conn, theirs = mp.Pipe()
    child = mp.get_context("fork").Process(target=_child, args=(theirs,), daemon=True)
    child.start()
    print(f"{cpu()}; {args.mib:g} MiB bodies, medians of {args.rounds} rounds\n")
    print("| form | decode thread: longest wait (ms) | its time (ms) | decode process: longest wait (ms) "
          "| its time (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for form, make in FORMS.items():
            body = make(int(args.mib * 2**20)).content
            path = f"/dev/shm/json_offload_{os.getpid()}"
            Path(path).write_bytes(body)
            thread, process = [], []
            for _ in range(args.rounds):
                thread.append(_timed(lambda: decode_body(body, _registry))[:2])  # noqa: B023
                process.append(_timed(lambda: _in_child(conn, path, len(body)))[:2])  # noqa: B023
            os.unlink(path)
            cells = [statistics.median(column) for rows in (thread, process) for column in zip(*rows, strict=True)]
            print(f"| {form} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    finally:
        conn.send(None)
        child.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
