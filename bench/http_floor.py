"""The cost of HTTP alone, on the same pinning as bench/run.py: uvicorn + FastAPI answering
GET /health/live, and an app that receives each workload's body and answers a response of the
service's size without doing any work (bench/echo_app.py), at concurrency 1 and 16: as a FastAPI
route (what the plain server's HTTP costs) and as a bare ASGI app (uvicorn's own floor, below which
no app on uvicorn goes); and W2's binary request (786 KB in and out), what the Open Inference
Protocol's binary tensors cost in HTTP alone.

    python bench/http_floor.py [--duration 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import PIN, SERVER_CPU, binary_request, service_env, workloads, wrk  # noqa: E402

from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import attend  # noqa: E402
from tests.server import free_port, running_service  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--duration", type=float, default=8.0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="attend-floor-"))
    rows = []

    with running_service(args.repository, prefix=PIN, **service_env(True, {})) as (url, _):
        out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", "-c1", f"-d{round(args.duration)}s",
                              f"{url}/health/live"], capture_output=True, text=True, check=True)
        rps = float(next(x for x in out.stdout.splitlines() if x.startswith("Requests/sec")).split()[-1])
        rows.append(("GET /health/live (the service)", "-", f"{rps:.0f}", "-"))

    registry = Registry.load(args.repository, "cpu", 1)
    echoes = []  # (row label, the app in bench/echo_app.py, request body, response body, concurrencies)
    for name, (_, body) in workloads().items():
        raw = json.dumps(body).encode()
        for app, how in (("app", "FastAPI"), ("raw_app", "bare ASGI")):
            echoes.append((f"echo of {name}, {how}", app, raw, attend(raw, registry), (1, 16)))
    # W2 as Open Inference Protocol binary tensors: 786 KB in, as many bytes out.
    binary, _ = binary_request(workloads()["W2"][1])
    echoes.append(("echo of W2 binary, FastAPI", "app", binary, bytes(len(binary)), (1, 16)))
    for label, app, raw, response, concurrencies in echoes:
        (tmp / "request").write_bytes(raw)
        (tmp / "response").write_bytes(response)
        port = free_port()
        env = os.environ | {"ECHO_RESPONSE": str(tmp / "response")}
        echo = subprocess.Popen(["taskset", "-c", str(SERVER_CPU), sys.executable, "-m", "uvicorn",
                                 f"bench.echo_app:{app}", "--port", str(port), "--log-level", "warning"],
                                cwd=ROOT, env=env)
        try:
            for _ in range(100):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/docs", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            for c in concurrencies:
                wrk(port, tmp / "request", c, 2)
                r = wrk(port, tmp / "request", c, args.duration)
                rows.append((f"{label} (receive {len(raw) / 1024:.0f} KB, send {len(response) / 1024:.0f} KB)",
                             str(c), f"{r['rps']:.0f}", f"{r['p50_us'] / 1e3:.2f}"))
        finally:
            echo.send_signal(signal.SIGTERM)
            echo.wait(timeout=30)
    print("| HTTP only | concurrency | req/s | p50 ms |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
