"""Where each server's in-process time goes on the bodies `make bench` sends, stage by stage: the service's
codec and run (service.protocols.attend: the JSON parse, the arrays and every check, the session run, the
JSON encode) against the plain server's route (bench/plain_server.py: orjson.loads, its np.asarray and
valid lengths, the session run, orjson.dumps), no HTTP and no batching: what each does with a body once
it has it. One core, one ONNX Runtime thread, one process holding both.

Each workload's pool (bench/pools.py) goes through both, every body, a pass each in turn (the order
swapped every other pass); a figure is a body's mean over one pass, and the median of the passes. The
plain server's stages are timed around its own calls (orjson's and the session's, wrapped where its route
looks them up), and the rest of its route (arrays, valid lengths, the answer's dict) is its total less
them and less the Response it builds (a framework's part, as the service's HTTP layer's is not timed
either). The service's run is `LoadedModel.run`: the dict of its outputs and the view of dot_product's
weights are in it, where the plain server's fall in the rest of its route. Before timing, each body's
answers from the two are compared: the same outputs and weights, or the bench stops.

    python bench/breakdown.py [--workloads W1,W3,W4,W5,W6,W7] [--passes 5] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pools import SEED, WORKLOADS, attend_json  # noqa: E402
from run import SERVER_CPU  # noqa: E402

from service.core.runtime import Registry  # noqa: E402
from service.protocols.attend import FIELDS, attend, decode_body, encode_attend, parse  # noqa: E402
from tests.load.report import write_section  # noqa: E402

STAGES = ("JSON parse", "arrays and checks", "session run", "JSON encode")
SECTION = "breakdown"


class _Timed:
    """`call`, its seconds added to `spent[stage]`."""

    def __init__(self, call: Callable, spent: dict[str, float], stage: str):
        self.call, self.spent, self.stage = call, spent, stage

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.spent[self.stage] += time.perf_counter() - start


def _unwrapped(call: Callable) -> Callable:
    """What a _Timed times (a second Plain in one process times the plain server's calls, not the first's timers)."""
    return call.call if isinstance(call, _Timed) else call


class _Request:
    """What the plain server's route reads of a Starlette Request: its body."""

    def __init__(self, raw: bytes):
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


class Plain:
    """bench/plain_server.py's route, called as a function, its orjson and sessions timed in `spent`."""

    def __init__(self, repository: Path):
        os.environ["PLAIN_REPOSITORY"] = str(repository)
        import plain_server

        self.spent = dict.fromkeys([*STAGES, "response"], 0.0)
        plain_server.Response = _Timed(_unwrapped(plain_server.Response), self.spent, "response")
        plain_server.orjson = types.SimpleNamespace(loads=_Timed(orjson.loads, self.spent, "JSON parse"),
                                                    dumps=_Timed(orjson.dumps, self.spent, "JSON encode"),
                                                    OPT_SERIALIZE_NUMPY=orjson.OPT_SERIALIZE_NUMPY)
        for name, session in list(plain_server.sessions.items()):
            run = _Timed(_unwrapped(session.run), self.spent, "session run")
            plain_server.sessions[name] = types.SimpleNamespace(run=run)
        self.route = plain_server.attend

    def answer(self, raw: bytes) -> bytes:
        coroutine = self.route(_Request(raw))
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value.body
        raise RuntimeError("the plain server's route waited on something")

    def timed(self, raw: bytes, spent: dict[str, float]) -> None:
        before = dict(self.spent)
        start = time.perf_counter()
        self.answer(raw)
        total = time.perf_counter() - start
        own = {stage: self.spent[stage] - before[stage] for stage in self.spent}
        own["arrays and checks"] = total - sum(own.values())
        for stage in STAGES:
            spent[stage] += own[stage]


class Service:
    """The service's codec and run on one body: service.protocols.attend.attend, and its stages timed apart."""

    def __init__(self, repository: Path):
        self.registry = Registry.load(repository, "cpu", 1)

    def answer(self, raw: bytes) -> bytes:
        return attend(raw, self.registry)

    def timed(self, raw: bytes, spent: dict[str, float]) -> None:
        t0 = time.perf_counter()
        parse(raw, FIELDS)
        t1 = time.perf_counter()
        request = decode_body(raw, self.registry)  # parses again: the arrays and checks are its time less t1 - t0
        t2 = time.perf_counter()
        outputs = request.model.run(request.feed, request.return_weights)
        t3 = time.perf_counter()
        encode_attend(request.model, outputs, request.return_weights)
        t4 = time.perf_counter()
        spent["JSON parse"] += t1 - t0
        spent["arrays and checks"] += (t2 - t1) - (t1 - t0)
        spent["session run"] += t3 - t2
        spent["JSON encode"] += t4 - t3


def same_answers(service: bytes, plain: bytes) -> bool:
    """Whether two answers hold the same outputs (weights, P) to float32's last digits."""
    a, b = orjson.loads(service), orjson.loads(plain)
    names = [k for k in b if k != "model"]
    return all(k in a and np.allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-6, atol=1e-7) for k in names)


def measure(servers: dict[str, Service | Plain], bodies: list[bytes], passes: int) -> dict[str, dict[str, float]]:
    """Microseconds a body of each stage, for each server: medians over `passes` passes of the pool, the
    servers taking turns pass by pass."""
    figures: dict[str, dict[str, list[float]]] = {name: {s: [] for s in STAGES} for name in servers}
    order = list(servers)
    for done in range(passes):
        for name in order if done % 2 == 0 else order[::-1]:
            spent = dict.fromkeys(STAGES, 0.0)
            for raw in bodies:
                servers[name].timed(raw, spent)
            for stage in STAGES:
                figures[name][stage].append(1e6 * spent[stage] / len(bodies))
    return {name: {s: statistics.median(v) for s, v in stages.items()} for name, stages in figures.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--workloads", default="W1,W3,W4,W5,W6,W7", help="bench/pools.py's pools of varied bodies")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--bodies", type=int, help="only the first BODIES of each pool")
    parser.add_argument("--out", type=Path, help=f"a markdown file with a <!-- {SECTION} --> section")
    args = parser.parse_args()
    os.sched_setaffinity(0, {SERVER_CPU})
    servers: dict[str, Service | Plain] = {"service": Service(args.repository), "plain": Plain(args.repository)}
    head = " | ".join(f"{stage} us" for stage in STAGES)
    table = [f"| workload | bodies | {head} | in all us | service / plain |",
             "| --- | ---: |" + " ---: |" * (len(STAGES) + 2)]
    print("\n".join(table), flush=True)
    for workload in args.workloads.split(","):
        bodies = [attend_json(body)[1] for body in WORKLOADS[workload].bodies(SEED, args.bodies)]
        for raw in bodies:  # the same numbers from both, and every plan and cache warm
            if not same_answers(servers["service"].answer(raw), servers["plain"].answer(raw)):
                raise SystemExit(f"{workload}: the two servers answer {raw[:200]!r} with other numbers")
        figures = measure(servers, bodies, args.passes)
        service, plain = figures["service"], figures["plain"]
        cells = " | ".join(f"{service[s]:.1f} / {plain[s]:.1f}" for s in STAGES)
        total = {name: sum(f.values()) for name, f in figures.items()}
        table.append(f"| {workload} | {len(bodies)} | {cells} | {total['service']:.1f} / {total['plain']:.1f} | "
                     f"{total['service'] / total['plain']:.2f} |")
        print(table[-1], flush=True)
    if args.out:
        write_section(args.out, SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
