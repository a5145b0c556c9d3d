"""What a large JSON body's decode holds the GIL for, on a decode thread and with a decode process: the /attend
codec's decode (service.protocols.attend.AttendCodec.decode) as the service runs it with ATTEND_JSON_PROCESSES=0
(simdjson's parse and the arrays' reading on the thread, holding the GIL) and with its default, one process
(service.protocols.json_process: the thread writes the body to it and maps the arrays back). Per form of body
(tests/load/bodies.py), the longest a thread ticking beside it waited for the GIL (the event loop's wait) and
the decode's time, medians over rounds.

    python bench/json_offload.py [--mib 24] [--rounds 3] [--repository model_repository]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compute import cpu  # noqa: E402

from service.config import Settings  # noqa: E402
from service.core.cost import Budget, Cost  # noqa: E402
from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import AttendCodec  # noqa: E402
from service.protocols.json_process import JsonProcesses  # noqa: E402
from tests.load.bodies import json_dense, json_long  # noqa: E402
from tests.load.gil import longest_wait  # noqa: E402

FORMS = {"long decimals": json_long, "dense": json_dense}


def _timed(core: types.SimpleNamespace, body: bytes) -> tuple[float, float]:
    """(the longest a thread beside the decode waited for the GIL, the decode's time) in ms."""
    waited, took, _ = longest_wait(lambda: AttendCodec().decode(core, (None, None), {}, body, Cost(Budget(1 << 50))))
    return waited * 1e3, took * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=24.0, help="each body's size, MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the service's (service.core.dataplane)
    registry = Registry.load(args.repository, "cpu", 1)
    processes = JsonProcesses(1)
    limits = Settings().request_limits()
    on_thread = types.SimpleNamespace(registry=registry, limits=limits, json_processes=None)
    in_process = types.SimpleNamespace(registry=registry, limits=limits, json_processes=processes)
    print(f"{cpu()}; {args.mib:g} MiB bodies, medians of {args.rounds} rounds\n")
    print("| form | decode thread: longest wait (ms) | its time (ms) | decode process: longest wait (ms) "
          "| its time (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for form, make in FORMS.items():
            body = make(int(args.mib * 2**20)).content
            _timed(in_process, body)  # the process's first parse: its imports' pages
            thread, process = [], []
            for _ in range(args.rounds):
                thread.append(_timed(on_thread, body))
                process.append(_timed(in_process, body))
            cells = [statistics.median(column) for rows in (thread, process) for column in zip(*rows, strict=True)]
            print(f"| {form} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    finally:
        processes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
