"""What a large JSON body's decode holds the GIL for, on a decode thread and with a decode process: the /attend
codec's decode (service.protocols.attend.AttendCodec.decode; the Open Inference Protocol's for its JSON tensors,
service.protocols.v2.InferCodec) as the service runs it with ATTEND_JSON_PROCESSES=0
(simdjson's parse and the arrays' reading on the thread, holding the GIL) and with its default, one process
(service.protocols.json_process: the thread writes the body to it and maps the arrays back). Per form of body
(tests/load/bodies.py), the longest a thread ticking beside it waited for the GIL (the event loop's wait) and
the decode's time, medians over rounds.

Then served (unless --served-seconds 0): the service on one core and on two (taskset), processes 0 and 1, two
clients sending large /attend bodies back to back while a third sends the book's toy request one at a time: the toy
requests a second and their p50, p99 and longest, and the large bodies a second.

    python bench/json_offload.py [--mib 24] [--rounds 3] [--served-mib 8] [--served-seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compute import cpu  # noqa: E402

from service.config import Settings  # noqa: E402
from service.core.cost import Budget, Cost  # noqa: E402
from service.core.runtime import Registry  # noqa: E402
from service.http.schemas import toy_request  # noqa: E402
from service.protocols.attend import AttendCodec  # noqa: E402
from service.protocols.json_process import JsonProcesses  # noqa: E402
from service.protocols.v2 import InferCodec, parse_path  # noqa: E402
from tests.load.bodies import ATTEND, Body, json_dense, json_long, v2_json_dense  # noqa: E402
from tests.load.gil import longest_wait  # noqa: E402
from tests.server import running_service  # noqa: E402

FORMS = {"long decimals": json_long, "dense": json_dense, "OIP JSON, dense": v2_json_dense}
SERVED = ("long decimals", "dense")  # /attend's


def _timed(core: types.SimpleNamespace, body: Body) -> tuple[float, float]:
    """(the longest a thread beside the decode waited for the GIL, the decode's time) in ms."""
    codec, target = (AttendCodec(), (None, None)) if body.path == ATTEND else (InferCodec(), parse_path(body.path))
    headers = {k.encode(): v.encode() for k, v in body.headers.items()}
    waited, took, _ = longest_wait(lambda: codec.decode(core, target, headers, body.content, Cost(Budget(1 << 50))))
    return waited * 1e3, took * 1e3


def served(repository: Path, cores: str, processes: str, large: bytes, seconds: float) -> list[float]:
    """[toy requests a second, their p50, p99 and longest ms, large bodies a second] with the service on `cores`."""
    toy = json.dumps(toy_request()).encode()
    with running_service(repository, prefix=("taskset", "-c", cores), ATTEND_JSON_PROCESSES=processes,
                         ATTEND_INTRA_OP_THREADS="1", ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30)) as (url, _):
        stop, large_done = threading.Event(), []

        def send_large() -> None:
            with httpx.Client(base_url=url, timeout=120) as client:
                while not stop.is_set():
                    answer = client.post("/attend", content=large, headers={"content-type": "application/json"})
                    assert answer.status_code == 200, answer.text[:300]
                    large_done.append(1)

        senders = [threading.Thread(target=send_large) for _ in range(2)]
        times = []
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(50):  # warm: the toy request's plan, the connection
                client.post("/attend", content=toy)
            for sender in senders:
                sender.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                start = time.perf_counter()
                assert client.post("/attend", content=toy).status_code == 200
                times.append(time.perf_counter() - start)
        stop.set()
        for sender in senders:
            sender.join()
    ms = np.array(times) * 1e3
    return [len(ms) / seconds, *np.percentile(ms, [50, 99]), ms.max(), len(large_done) / seconds]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=24.0, help="each body's size, MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--served-mib", type=float, default=8.0, help="the large bodies' size when served, MiB")
    parser.add_argument("--served-seconds", type=float, default=8.0, help="a point's time served; 0: none")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the service's (service.core.dataplane)
    registry = Registry.load(args.repository, "cpu", 1)
    processes = JsonProcesses(1)
    limits = Settings().request_limits()
    plain = {"registry": registry, "limits": limits, "regions": None, "inline_decode_bytes": 0, "loop_thread": None}
    on_thread = types.SimpleNamespace(**plain, json_processes=None)
    in_process = types.SimpleNamespace(**plain, json_processes=processes)
    print(f"{cpu()}; {args.mib:g} MiB bodies, medians of {args.rounds} rounds\n")
    print("| form | decode thread: longest wait (ms) | its time (ms) | decode process: longest wait (ms) "
          "| its time (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    try:
        for form, make in FORMS.items():
            body = make(int(args.mib * 2**20))
            _timed(in_process, body)  # the process's first parse: its imports' pages
            thread, process = [], []
            for _ in range(args.rounds):
                thread.append(_timed(on_thread, body))
                process.append(_timed(in_process, body))
            cells = [statistics.median(column) for rows in (thread, process) for column in zip(*rows, strict=True)]
            print(f"| {form} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    finally:
        processes.close()
    if args.served_seconds <= 0 or len(os.sched_getaffinity(0)) < 2:
        return 0
    print(f"\nServed, {args.served_mib:g} MiB large bodies, {args.served_seconds:g} s a point:\n")
    print("| form | cores | processes | toy requests / s | p50 ms | p99 ms | longest ms | large bodies / s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for form in SERVED:
        large = FORMS[form](int(args.served_mib * 2**20)).content
        for cores in ("0", "0,1"):
            for count in ("0", "1"):
                row = served(args.repository, cores, count, large, args.served_seconds)
                print(f"| {form} | {cores} | {count} | {row[0]:.0f} | {row[1]:.1f} | {row[2]:.1f} | {row[3]:.0f} | "
                      f"{row[4]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
