"""Connections dropped at SIGTERM: how many connections the kernel accepted for the service (the client's
connect() succeeded, its request sent) and that were then reset or closed unanswered, while the service
stopped under load. Each is a request lost without an answer, which a client cannot tell from a failure
mid-request; the service's promise is none (answered, or refused at connect).

    python bench/sigterm_drops.py [SERVER ...] [--rounds 15] [--workers 2]

SERVER is a checkout (`git worktree add /tmp/base <commit>`; default: this one), optionally with
`+NAME=VALUE,...` settings. Round by round, alternating the servers: start it; heavy clients (8 x 256 x 64
dot-product bodies, ~8 MB of JSON, whose decode takes the workers' GIL) and small clients (the toy request,
a new connection each, as fast as they go) for a second; SIGTERM; the small clients go on for 3 s more.
Prints, per server: rounds, requests answered 200, connections refused, dropped ones and when (seconds
after the signal).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ab import checkout  # noqa: E402

from service.http.schemas import toy_request  # noqa: E402
from tests.server import running_service  # noqa: E402

TOY = json.dumps(toy_request()).encode()
REQUEST = b"POST /attend HTTP/1.1\r\nHost: attend\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(TOY), TOY)


def small_client(port: int, until: float, results: mp.Queue) -> None:
    """Toy requests, one connection each, until `until`: counts, and the times of the dropped ones."""
    answered = refused = other = 0
    dropped: list[float] = []
    while time.monotonic() < until:
        with socket.socket() as s:
            try:
                s.connect(("127.0.0.1", port))
            except OSError:  # refused, or reset in the handshake: its request never left
                refused += 1
                time.sleep(0.001)
                continue
            head = b""
            try:
                s.sendall(REQUEST)
                while b"\r\n\r\n" not in head:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    head += chunk
            except (ConnectionResetError, BrokenPipeError):
                head = b""
            if head.startswith(b"HTTP/1.1 200 "):
                answered += 1
            elif not head:
                dropped.append(time.monotonic())
            else:
                other += 1
    results.put((answered, refused, other, dropped))


def heavy_client(port: int, until: float, body: bytes) -> None:
    import httpx

    while time.monotonic() < until:
        try:
            httpx.post(f"http://127.0.0.1:{port}/attend", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        except httpx.HTTPError:
            time.sleep(0.01)


def round_of(spec: str, repository: Path, workers: int, body: bytes, clients: int) -> tuple[int, int, int, list[float]]:
    command, extra = checkout(spec)
    env = {"ATTEND_WORKERS": str(workers), "ATTEND_INTRA_OP_THREADS": "1", "ATTEND_GRACE_PERIOD_S": "60",
           "ATTEND_MAX_INFLIGHT_BYTES": str(4 << 30)} | extra
    with running_service(repository, command=command, **env) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        time.sleep(1.0)  # every worker up
        results: mp.Queue = mp.Queue()
        start = time.monotonic()
        processes = [mp.Process(target=heavy_client, args=(port, start + 1.5, body)) for _ in range(3)]
        processes += [mp.Process(target=small_client, args=(port, start + 4.0, results)) for _ in range(clients)]
        for p in processes:
            p.start()
        time.sleep(max(0.0, start + 1.0 - time.monotonic()))
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        counts = [results.get() for _ in range(clients)]
        for p in processes:
            p.join()
        proc.wait(timeout=60)
    return (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts),
            [t - signalled for c in counts for t in c[3]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="*", metavar="SERVER", default=[str(ROOT)])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4, help="small clients (processes)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    body = json.dumps({"model": "dot_product", **{k: rng.normal(size=(8, 256, 64)).tolist()
                                                  for k in ("queries", "keys", "values")}}).encode()
    totals = {spec: [0, 0, 0, []] for spec in args.servers}
    for r in range(args.rounds):
        for spec in args.servers:
            answered, refused, other, dropped = round_of(spec, args.repository, args.workers, body, args.clients)
            total = totals[spec]
            total[0] += answered
            total[1] += refused
            total[2] += other
            total[3] += dropped
            print(f"round {r + 1} {spec}: {answered} answered, {refused} refused, {len(dropped)} dropped", flush=True)
    print(f"\n{args.rounds} rounds, {args.workers} workers, {args.clients} small clients; "
          f"`python bench/sigterm_drops.py {' '.join(sys.argv[1:])}`\n")
    print("| server | answered 200 | refused | other | dropped | dropped at (s after SIGTERM) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for spec, (answered, refused, other, dropped) in totals.items():
        at = ", ".join(f"{t:.3f}" for t in sorted(dropped)) or "-"
        print(f"| {spec} | {answered} | {refused} | {other} | {len(dropped)} | {at} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
