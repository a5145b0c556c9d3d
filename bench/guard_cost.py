"""What the guarded HTTP protocol (service/server.py: header and body deadlines, header size, requests
in progress, body bytes in flight) costs a request, against uvicorn's own httptools protocol: the
same trivial ASGI app (reads the body, answers 2 bytes of JSON) under each, pinned to one core, wrk
on the other, alternating, the median of the repeats. The body is W1's (the book's toy request).

    python bench/guard_cost.py [--seconds 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from echo_app import drain  # noqa: E402
from run import PIN, machine, wrk  # noqa: E402

from service.http.schemas import toy_request  # noqa: E402
from tests.server import running_service  # noqa: E402

PROTOCOLS = {"httptools": "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol",
             "guarded": "service.http.protocol:GuardedProtocol"}


async def app(scope, receive, send):  # the least an app can do with a POST
    if scope["type"] != "http":
        return
    await drain(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


def serve(port: int, protocol: str) -> None:
    import importlib

    import uvicorn

    module, name = PROTOCOLS[protocol].split(":")
    uvicorn.run(app, host="127.0.0.1", port=port, http=getattr(importlib.import_module(module), name),
                log_level="warning", access_log=False, limit_concurrency=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "PROTOCOL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return 0
    body = Path(tempfile.mkdtemp()) / "body.json"
    body.write_bytes(json.dumps(toy_request()).encode())
    results: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeat):
        order = list(PROTOCOLS) if repeat % 2 == 0 else list(PROTOCOLS)[::-1]
        for protocol in order:
            command = (sys.executable, str(Path(__file__).resolve()), "--serve", "{port}", protocol)
            with running_service(ROOT, prefix=PIN, command=command, ready_path="/") as (url, proc):
                port = int(url.rsplit(":", 1)[1])
                wrk(port, body, 16, 1, path="/")  # warm-up
                for connections in (1, 16):
                    results.setdefault((protocol, connections), []).append(
                        wrk(port, body, connections, args.seconds, pid=proc.pid, path="/"))
    print(f"Run on: {machine()}")
    print(f"Command: `python bench/guard_cost.py --seconds {args.seconds:g} --repeat {args.repeat}` "
          "(the median of the repeats)\n")
    print("| concurrency | protocol | req/s | CPU us / request | x httptools (CPU) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for connections in (1, 16):
        base = statistics.median(r["cpu_us"] for r in results[("httptools", connections)])
        for protocol in PROTOCOLS:
            runs = results[(protocol, connections)]
            rps = statistics.median(r["rps"] for r in runs)
            cpu = statistics.median(r["cpu_us"] for r in runs)
            print(f"| {connections} | {protocol} | {rps:.0f} | {cpu:.1f} | {cpu / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
