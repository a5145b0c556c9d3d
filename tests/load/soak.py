"""Soak: the locustfile, headless, against the real service process for a bounded time, with the
server's resident memory sampled throughout.

    python tests/load/soak.py [--minutes 4] [--warmup 60] [--users 16] [--out docs/reliability.md]

Passes (exit 0) when locust saw no unexpected failure and the resident memory at the end is
less than 10% above the one after warm-up. Prints a markdown table; --out writes it with the
machine and the command.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.server import running_service  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--minutes", type=float, default=4.0, help="whole run, warm-up included")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline memory sample")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seconds = int(args.minutes * 60)
    samples: list[tuple[float, float]] = []
    tmp = Path(tempfile.mkdtemp(prefix="attend-soak-"))
    with running_service(args.repository, ATTEND_LOG_LEVEL="warning") as (url, proc):
        stop = threading.Event()
        start = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - start, rss_mib(proc.pid)))
                stop.wait(5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        locust = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "tests/load/locustfile.py"), "--headless",
             "-u", str(args.users), "-r", str(args.users), "-t", f"{seconds}s", "--host", url,
             "--csv", str(tmp / "soak"), "--only-summary", "--stop-timeout", "10"],
            capture_output=True, text=True, cwd=tmp)
        stop.set()
        sampler.join()
        samples.append((time.monotonic() - start, rss_mib(proc.pid)))
        alive = proc.poll() is None

    with open(tmp / "soak_stats.csv") as f:
        total = next(row for row in csv.DictReader(f) if row["Name"] == "Aggregated")
    requests, failures = int(total["Request Count"]), int(total["Failure Count"])
    baseline = next(rss for t, rss in samples if t >= args.warmup)
    final = samples[-1][1]
    peak = max(rss for _, rss in samples)
    growth = (final - baseline) / baseline
    ok = failures == 0 and growth < 0.10 and alive and locust.returncode == 0
    table = "\n".join([
        "| figure | value |", "| --- | ---: |",
        f"| duration | {seconds} s, {args.users} users |",
        f"| requests | {requests} ({float(total['Requests/s']):.0f}/s) |",
        f"| unexpected failures | {failures} |",
        f"| p50 / p99 latency | {total['50%']} / {total['99%']} ms |",
        f"| resident memory after {args.warmup:.0f} s warm-up | {baseline:.1f} MiB |",
        f"| resident memory at the end | {final:.1f} MiB ({100 * growth:+.1f}%) |",
        f"| peak resident memory | {peak:.1f} MiB |",
        f"| verdict | {'pass' if ok else 'FAIL'} |",
    ])
    print(table)
    if not ok:
        print(locust.stdout[-3000:], locust.stderr[-3000:], file=sys.stderr)
    if args.out:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        command = " ".join(["python tests/load/soak.py", f"--minutes {args.minutes:g}", f"--warmup {args.warmup:g}",
                            f"--users {args.users}"])
        args.out.write_text(f"Run {stamp} on {cpu}, {os.cpu_count()} cores; command: `{command}`\n\n{table}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
