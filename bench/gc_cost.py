"""What Python's garbage collector costs the service a request, under `make bench`'s load: collections and
the objects they free (reference cycles the request path left), and the time they took (each collection
timed through `gc.callbacks`, by a sitecustomize this script puts on the service's PYTHONPATH), for one
or more checkouts of this repository.

    python bench/gc_cost.py [SERVER ...] [--rows W1,W7] [--concurrency 1,16] [--seconds 5]

SERVER is a checkout (`git worktree add /tmp/base <commit>`; default: this one), optionally with
`+NAME=VALUE,...` settings, served as bench/ab.py serves it (`ab.serve`): pinned to core 0, wrk with
bench/pool.lua on core 1, the rows' pools of varied bodies. Each point is measured after a warm-up of 2 s;
the counts are per request of the point, but gen 2 (full collections, each a pause of the event loop) and
those over 5 ms, counted in the point.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ab import serve  # noqa: E402
from loadgen import measure  # noqa: E402
from pools import ROWS, SEED, TRANSPORTS, make_pools  # noqa: E402

# Loaded by the service's interpreter at start (PYTHONPATH): every collection timed, the totals written
# to GC_STATS (generation 0, 1, 2 collections; objects collected; seconds; those over 5 ms) every 0.2 s.
SITECUSTOMIZE = '''
import gc, os, threading, time
_path = os.environ.get("GC_STATS")
if _path:
    _started = [0.0]
    _totals = [0, 0, 0, 0, 0.0, 0]

    def _timed(phase, info):
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        took = time.perf_counter() - _started[0]
        _totals[info["generation"]] += 1
        _totals[3] += info["collected"]
        _totals[4] += took
        _totals[5] += took > 0.005

    def _write():
        while True:
            time.sleep(0.2)
            with open(_path + ".tmp", "w") as f:
                f.write(" ".join(map(str, _totals)))
            os.replace(_path + ".tmp", _path)

    gc.callbacks.append(_timed)
    threading.Thread(target=_write, daemon=True, name="gc-stats").start()
'''


def totals(path: Path) -> list[float]:
    time.sleep(0.5)  # the next write
    return [float(x) for x in path.read_text().split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("servers", nargs="*", metavar="SERVER", default=["."])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rows", default="W1,W3,W7", help=f"rows: {', '.join(ROWS)}")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--seconds", type=float, default=5.0, help="per point (whole seconds)")
    parser.add_argument("--seed", type=int, default=SEED, help="the pools' seed")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    tmp = Path(tempfile.mkdtemp(prefix="attend-gc-"))
    print("| row | c | server | requests | gen 0 / 1000 req | gen 1 / 1000 req | gen 2 | objects collected / req "
          "| GC us / req | over 5 ms |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        pools = make_pools(tmp, rows, args.seed)
        for spec in args.servers:
            stats = tmp / f"gc-{len(list(tmp.glob('gc-*')))}"
            with serve(args.repository, spec, PYTHONPATH=str(tmp / "site"), GC_STATS=str(stats)) as (url, proc):
                port = int(url.rsplit(":", 1)[1])
                for row in rows:
                    client, index = TRANSPORTS[ROWS[row][1]].client, pools[row]["index"]
                    for c in (int(c) for c in args.concurrency.split(",")):
                        print(f"{row} c={c} {spec} ...", file=sys.stderr)
                        measure(client, port, index, c, 2)  # warm-up
                        before = totals(stats)
                        point = measure(client, port, index, c, args.seconds)
                        after = totals(stats)
                        if not point.ok:
                            raise RuntimeError(f"{row} c={c} {spec}: {point.failed} failed {point.statuses}")
                        n = point.requests
                        d = [b - a for a, b in zip(before, after, strict=True)]
                        print(f"| {row} | {c} | {spec} | {n} | {1000 * d[0] / n:.1f} | {1000 * d[1] / n:.2f} | "
                              f"{d[2]:.0f} | {d[3] / n:.2f} | {1e6 * d[4] / n:.1f} | {d[5]:.0f} |",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
