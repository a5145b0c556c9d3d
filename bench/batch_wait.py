"""What `ATTEND_MAX_BATCH_WAIT_US` buys and costs, on the same pinning as bench/run.py.

    python bench/batch_wait.py [--waits 300,1000] [--duration 5] [--repeat 2]

A batch waits for more requests while the server has more open connections than the batch has
requests. Two loads show both sides of that: every connection busy (wrk -c16: the wait fills the
batch), and a few busy clients beside idle keep-alive connections (wrk -c2 and -c4, plus `--idle`
connections that only stay open: the wait is paid for requests that never come). Prints requests/s,
p50 latency, the server's CPU per request and the mean requests per session run (from /metrics),
the median of `--repeat` runs, the waits alternating.

uvloop's timers count whole milliseconds (`round(delay * 1000)`, 0 being `call_soon`), so a wait
below 500 us is one more pass of the event loop, from 500 to 1499 us one millisecond.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import PIN, service_env, workloads, wrk  # noqa: E402

from tests.server import running_service  # noqa: E402


def batches(url: str) -> tuple[float, float]:
    """(requests, session runs) so far, over every model."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = {"sum": 0.0, "count": 0.0}
    for kind, value in re.findall(r"^attend_batch_requests_(sum|count)\{[^}]*\} (\S+)$", text, re.MULTILINE):
        total[kind] += float(value)
    return total["sum"], total["count"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--waits", default="300,1000", help="values of ATTEND_MAX_BATCH_WAIT_US to compare")
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--idle", type=int, default=12, help="idle keep-alive connections beside -c2 and -c4")
    args = parser.parse_args()
    waits = args.waits.split(",")
    loads = [(16, 0), (2, args.idle), (4, args.idle)]  # (busy connections, idle ones)
    tmp = Path(tempfile.mkdtemp(prefix="attend-wait-"))
    work = {k: v for k, v in workloads().items() if k in args.workloads.split(",")}
    for name, (_, body) in work.items():
        (tmp / f"{name}.json").write_bytes(json.dumps(body).encode())
    measured: dict[tuple, list[dict]] = {}
    for rep in range(args.repeat):
        for wait in waits if rep % 2 == 0 else waits[::-1]:
            for name in work:
                env = service_env(True, {"ATTEND_MAX_BATCH_WAIT_US": wait})
                with running_service(args.repository, prefix=PIN, **env) as (url, proc):
                    port = int(url.rsplit(":", 1)[1])
                    for busy, idle in loads:
                        print(f"[{rep + 1}/{args.repeat}] wait {wait} us, {name}, c={busy} + {idle} idle ...",
                              file=sys.stderr)
                        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
                        try:
                            wrk(port, tmp / f"{name}.json", busy, 1)
                            before = batches(url)
                            r = wrk(port, tmp / f"{name}.json", busy, args.duration, proc.pid)
                            after = batches(url)
                        finally:
                            for s in sockets:
                                s.close()
                        if r["non_2xx"] or r["timeout"] or r["read"] or r["connect"]:
                            raise RuntimeError(f"{name} c={busy} wait {wait}: errors {r}")
                        r["per_run"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
                        measured.setdefault((name, busy, idle, wait), []).append(r)
    print("| workload | busy connections | idle connections | ATTEND_MAX_BATCH_WAIT_US | req/s | p50 ms | "
          "CPU us / request | requests a run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in work:
        for busy, idle in loads:
            for wait in waits:
                runs = measured[(name, busy, idle, wait)]
                m = {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_us", "cpu_us", "per_run")}
                print(f"| {name} | {busy} | {idle} | {wait} | {m['rps']:.0f} | {m['p50_us'] / 1e3:.2f} | "
                      f"{m['cpu_us']:.0f} | {m['per_run']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
