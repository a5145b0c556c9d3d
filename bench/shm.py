"""What system shared memory buys: perf_analyzer (bench/perf_analyzer.sh) on W2 over HTTP (binary tensors) and
gRPC (raw contents), each with the tensors in the requests and in system shared memory, one after the other
on a fresh service each; requests/s and p99 side by side, and the ratio.

    python bench/shm.py [--concurrency "1 2"] [--write]     --write: the table into docs/v2.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "v2.md"
BEGIN, END = "<!-- shm -->", "<!-- /shm -->"
ROW = re.compile(r"^\| (\d+) \| (\d+) \| \d+ \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \|$", re.MULTILINE)


def sweep(protocol: str, shared_memory: str, concurrency: str) -> dict[int, tuple[int, float, float]]:
    """concurrency -> (requests/s, p50 ms, p99 ms)."""
    # Windows of 1 s, at most 3 a point: perf_analyzer keeps every response (~1.6 MB a W2 request over HTTP;
    # at concurrency 4 it passed 8 GB), hence concurrency 1 and 2 by default.
    command = ["bash", "bench/perf_analyzer.sh", "--protocol", protocol, "--shared-memory", shared_memory,
               "--concurrency", concurrency, "--max-trials", "3", "--max-memory-gb", "8", "--stability", "999"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} exited with {result.returncode}:\n{result.stderr[-2000:]}")
    return {int(c): (int(r), float(p50), float(p99)) for c, r, p50, p99 in ROW.findall(result.stdout)}


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1 2")
    parser.add_argument("--write", action="store_true", help="put the table into docs/v2.md")
    args = parser.parse_args()
    lines = ["| protocol | concurrency | requests/s in the requests | in shared memory | ratio "
             "| p99 ms in the requests | in shared memory |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for protocol in ("http", "grpc"):
        plain, shared = sweep(protocol, "none", args.concurrency), sweep(protocol, "system", args.concurrency)
        for c in sorted(plain):
            (r0, _, p0), (r1, _, p1) = plain[c], shared[c]
            lines.append(f"| {protocol} | {c} | {r0} | {r1} | {r1 / r0:.2f}x | {p0:.2f} | {p1:.2f} |")
    table = "\n".join(lines)
    text = (f"perf_analyzer on W2 (dot_product, 8 x 128 x 128 x 64: 786 KB in, 786 KB out).\n"
            f"The service on one core, perf_analyzer on another; {cpu()}, {datetime.date.today()}.\n"
            f"Command: `python bench/shm.py --concurrency \"{args.concurrency}\" --write`.\n\n{table}")
    print(text)
    if args.write:
        doc = DOC.read_text()
        start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


if __name__ == "__main__":
    main()
