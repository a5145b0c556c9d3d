"""The memory one request can take: the service's peak resident memory (VmHWM) above its idle
resident memory, for the largest body and the largest attention weights the default limits allow.

    python tests/load/membound.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.config import Settings  # noqa: E402
from tests.server import running_service  # noqa: E402


def status_mib(pid: int, field: str) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def largest_body(limit: int) -> bytes:
    """dot_product with one long feature axis: as many float32 numbers as fit under the limit."""
    rng = np.random.default_rng(0)
    n = 4096
    batch = 1
    while True:  # grow the batch while the body stays under the limit (about 20 bytes per number)
        body = {"model": "dot_product", "queries": rng.normal(size=(batch, 1, n)).astype(np.float32).tolist(),
                "keys": rng.normal(size=(batch, 1, n)).astype(np.float32).tolist(),
                "values": rng.normal(size=(batch, 1, 1)).tolist()}
        if batch * 2 * n * 20 * 2 > limit:
            return json.dumps(body).encode()
        batch *= 2


def largest_weights(elements: int) -> bytes:
    n = 1024
    batch = max(1, elements // (n * n))
    rng = np.random.default_rng(0)
    return json.dumps({"model": "dot_product", "queries": rng.normal(size=(batch, n, 1)).round(3).tolist(),
                       "keys": rng.normal(size=(batch, n, 1)).round(3).tolist(),
                       "values": rng.normal(size=(batch, n, 1)).round(3).tolist()}).encode()


def main() -> int:
    settings = Settings()
    cases = {"largest body": largest_body(settings.max_body_bytes),
             "largest attention weights": largest_weights(settings.max_weight_elements)}
    print("| request | body MiB | response MiB | idle RSS MiB | peak RSS MiB | peak - idle |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, body in cases.items():
        with running_service(ROOT / "model_repository", ATTEND_LOG_LEVEL="warning",
                             ATTEND_INTRA_OP_THREADS="1") as (url, proc):
            idle = status_mib(proc.pid, "VmRSS")
            response = httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"},
                                  timeout=120)
            assert response.status_code == 200, response.text[:300]
            peak = status_mib(proc.pid, "VmHWM")
            print(f"| {name} | {len(body) / 2**20:.1f} | {len(response.content) / 2**20:.1f} | {idle:.0f} | "
                  f"{peak:.0f} | {peak - idle:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
