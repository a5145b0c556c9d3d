"""What an app costs a request without HTTP: each workload's body sent through the ASGI app itself
(lifespan started, one core, one ORT thread), one request at a time and 16 at once, for the service
and for the plain server (bench/plain_server.py). The HTTP server's own cost (uvicorn, sockets) is
what `bench/run.py` adds on top.

    python bench/asgi_overhead.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import SERVER_CPU, workloads  # noqa: E402


def _scope(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/attend", "raw_path": b"/attend", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}


async def one(app, body: bytes) -> int:
    status = 0

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(body), receive, send)
    return status


async def lifespan(app) -> asyncio.Task:
    """The app's lifespan, started; the task must be kept (a collected task would shut the app down)."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.get_running_loop().create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put))
    message = await outbox.get()
    assert message["type"] == "lifespan.startup.complete", message
    return task


async def measure(app, body: bytes, concurrency: int, seconds: float) -> float:
    """Microseconds of this process's CPU per request."""
    for _ in range(50):
        status = await one(app, body)
        assert status == 200, status
    done = 0
    start_cpu, end = time.process_time(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        statuses = await asyncio.gather(*(one(app, body) for _ in range(concurrency)))
        assert set(statuses) == {200}, statuses
        done += concurrency
    return 1e6 * (time.process_time() - start_cpu) / done


async def main_async(args) -> None:
    os.environ.setdefault("PLAIN_REPOSITORY", str(args.repository))
    from plain_server import app as plain

    from service.config import Settings
    from service.http.app import create_app

    service = create_app(Settings(model_repository=args.repository, device="cpu", intra_op_threads=1,
                                  log_level="info"))
    running = await lifespan(service)  # noqa: F841 (kept alive)
    bodies = {name: json.dumps(body).encode() for name, (_, body) in workloads().items()}
    print("| workload | concurrency | plain us / request | service us / request | service / plain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, body in bodies.items():
        if args.workloads and name not in args.workloads.split(","):
            continue
        for c in (1, 16):
            p = await measure(plain, body, c, args.seconds)
            s = await measure(service, body, c, args.seconds)
            print(f"| {name} | {c} | {p:.0f} | {s:.0f} | {s / p:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workloads", default="", help="comma-separated, e.g. W1,W3 (default: all)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {SERVER_CPU})
    import logging

    logging.basicConfig(level=logging.INFO, filename=os.devnull)  # the access log is written, to nowhere
    import uvloop  # what uvicorn runs

    uvloop.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
