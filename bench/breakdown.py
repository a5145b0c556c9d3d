"""Where the in-process time of each workload goes: the JSON parse (simdjson), arrays and checks
(service.protocols.attend), the ONNX Runtime session run, and the JSON encode (orjson). One core, one ORT
thread.

    python bench/breakdown.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import SERVER_CPU, workloads  # noqa: E402

from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import decode_body, encode_attend, parse  # noqa: E402


def per_call_ms(f, seconds: float = 2.0) -> float:
    for _ in range(5):
        f()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        f()
        calls += 1
    return 1e3 * (time.perf_counter() - start) / calls


def main() -> int:
    os.sched_setaffinity(0, {SERVER_CPU})
    registry = Registry.load(ROOT / "model_repository", "cpu", 1)
    print("| workload | body KB | JSON parse ms | arrays + checks ms | session run ms | encode ms | total ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (_, body) in workloads().items():
        raw = json.dumps(body).encode()
        request = decode_body(raw, registry)
        outputs = request.model.run(request.feed)
        parsed = per_call_ms(lambda raw=raw: parse(raw))
        decode = per_call_ms(lambda raw=raw: decode_body(raw, registry))
        run = per_call_ms(lambda r=request: r.model.run(r.feed))
        enc = per_call_ms(lambda o=outputs, m=request.model: encode_attend(m, o))
        print(f"| {name} | {len(raw) / 1024:.0f} | {parsed:.3f} | {decode - parsed:.3f} | {run:.3f} | {enc:.3f} | "
              f"{decode + run + enc:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
