"""What a dead worker costs every later scrape (ATTEND_WORKERS > 1): the files a scrape reads, and its time,
with each dead worker's files kept (as before) and folded into the files of the dead
(service.core.metrics.fold_dead_worker). The files are a real worker's, after requests, copied under new
pids, one copy a dead worker.

    python bench/metrics_files.py [--repository DIR] [--dead 0,10,100,300] [--scrapes 15]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compute import cpu  # noqa: E402
from tests.server import running_service  # noqa: E402
from tests.service.test_workers import JSON, TOY, worker_pids  # noqa: E402


def served_worker_files(repository: Path, into: Path) -> str:
    """A 2-worker service's metrics folder after 200 requests, copied into `into`; a worker's pid."""
    scratch = Path(tempfile.mkdtemp())
    try:
        with running_service(repository, timeout=180, ATTEND_WORKERS="2", ATTEND_GRAPH_TIMING_S="0",
                             TMPDIR=str(scratch)) as (url, _):
            deadline = time.monotonic() + 90
            while len(worker_pids(url)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            for _ in range(200):
                httpx.post(f"{url}/attend", content=TOY, headers=JSON).raise_for_status()
            [folder] = scratch.glob("attend-metrics-*")
            for file in folder.glob("*.db"):
                shutil.copy(file, into / file.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return min(f.name.rsplit("_", 1)[1].removesuffix(".db") for f in into.glob("counter_*.db"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--dead", default="0,10,100,300", help="dead workers, comma-separated")
    parser.add_argument("--scrapes", type=int, default=15, help="scrapes timed at each count (the median)")
    args = parser.parse_args(argv)

    served = Path(tempfile.mkdtemp())
    pid = served_worker_files(args.repository, served)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(served)
    from service.core import metrics  # its multiprocess mode is read at import

    metrics.MULTIPROCESS = True
    scraper = metrics.Metrics()

    def scrape(folder: Path) -> tuple[int, int, float]:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
        files = list(folder.glob("*.db"))
        times = []
        for _ in range(args.scrapes):
            started = time.perf_counter()
            scraper.exposition()
            times.append(time.perf_counter() - started)
        return len(files), sum(f.stat().st_size for f in files), 1e3 * statistics.median(times)

    print(f"# a scrape with dead workers' files, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{cpu()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| dead workers | files kept: files, KiB | a scrape (ms) | folded: files, KiB | a scrape (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for dead in (int(n) for n in args.dead.split(",")):
        kept, folded = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
        try:
            for folder in (kept, folded):
                for file in served.glob("*.db"):
                    shutil.copy(file, folder / file.name)
                for i in range(dead):
                    for kind in ("counter", "histogram"):
                        shutil.copy(served / f"{kind}_{pid}.db", folder / f"{kind}_{900000 + i}.db")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folded)
            for i in range(dead):
                metrics.fold_dead_worker(900000 + i)
            k_files, k_bytes, k_ms = scrape(kept)
            f_files, f_bytes, f_ms = scrape(folded)
            print(f"| {dead} | {k_files}, {k_bytes >> 10} | {k_ms:.1f} | {f_files}, {f_bytes >> 10} | {f_ms:.1f} |")
        finally:
            shutil.rmtree(kept)
            shutil.rmtree(folded)
    shutil.rmtree(served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
