"""Many processes, one GPU, without HTTP: the issue's two designs for feeding a GPU from many cores, at the
step where they differ, how a run reaches the session.

- `workers`: P processes, each with its own ONNX Runtime session (its own CUDA context), running one
  request at a time. ATTEND_WORKERS serves W2's largest requests so: past ATTEND_MAX_BATCH_ELEMENTS a
  request runs alone. `workers-batched`: each joins the requests waiting into one run.
- `engine`: P front-end processes hand each request to one engine process, which holds the only session
  (one CUDA context). Inputs and outputs go through shared memory, a slot a client; the slot's number
  through a pipe. `engine-batched`: the engine joins the requests waiting, from every front end.

    python bench/engine.py [--device cuda] [--processes 1,8] [--concurrency 64] [--seconds 3] [--results F]
                           [--out docs/benchmarks.md]
    python bench/engine.py --report --results F [--out docs/benchmarks.md]

The results go to --results (default docs/engine-<device>.json); --out writes the table into that file's
<!-- engine-<device> --> section.

Every request is W2's largest: dot_product, batch 8, 128 queries and keys, 64 features, outputs and
weights. One shape for all, so a joined batch is a plain concatenation: the best case for joining.
--concurrency clients in all, spread over the P processes, each sending one request after another, each
with inputs of its own (in its slot, as a decode into shared memory would leave them). A request is timed
from its hand-off to its outputs' arrival (in the slot, or as views of the joined run's). A client checks
its first answer and every 50th against its own CPU session's: a wrong slot would show. The P processes
run on cores 0..P-1, one intra-op thread a session; the engine on cores P..2P-1 where there are (the best
case for it: as many cores again), with P threads, so that P runs can be under way in both designs. HTTP
and decoding are left out: they cost the same in both.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import queue
import select
import struct
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run import machine  # noqa: E402
from scaling import Sampler  # noqa: E402

from export.repository import example_feed, read_config  # noqa: E402
from service.core.sessions import CUDA, open_session, preload_cuda, providers_for  # noqa: E402

MODES = ("workers", "workers-batched", "engine", "engine-batched")
SIZES = {"batch": 8, "n_q": 128, "n_k": 128, "n": 128, "d": 64, "value_size": 64}
CHECK_EVERY = 50
TOLERANCE = 1e-3  # CUDA (TF32 off) against the CPU: float32 sums in another order
STOP = -1


def session(model_dir: Path, device: str):
    """The session the service would open on `device` for batches with the weights, one intra-op thread."""
    if device != "cpu":
        preload_cuda()
    config = read_config(model_dir)
    made, failure = open_session(model_dir, config, config.graph_for(cpu=device == "cpu"), 1,
                                 providers_for(device, False))
    if device == "cuda" and made.get_providers()[0] != CUDA:
        raise SystemExit(f"CUDA cannot be used here: {failure}")
    return made


class Slots:
    """One slot a client in shared memory: the request's inputs and its answer's outputs."""

    def __init__(self, arrays: dict[str, tuple[tuple[int, ...], np.dtype]], count: int):
        self.layout, offset = {}, 0
        for name, (shape, dtype) in arrays.items():
            self.layout[name] = (offset, shape, dtype)
            offset += math.prod(shape) * np.dtype(dtype).itemsize
        self.size = offset
        self.shm = shared_memory.SharedMemory(create=True, size=max(self.size * count, 1))

    def view(self, slot: int, name: str) -> np.ndarray:
        offset, shape, dtype = self.layout[name]
        return np.ndarray(shape, dtype, self.shm.buf, slot * self.size + offset)

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


def pin(cores: int | list[int]) -> None:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {cores} if isinstance(cores, int) else set(cores))


def feed_of(model_dir: Path, client: int) -> dict[str, np.ndarray]:
    """Client `client`'s own inputs, with ragged valid lengths (one an example)."""
    config = read_config(model_dir)
    rng = np.random.default_rng(client)
    feed = example_feed(config.kind, config.hyperparameters, SIZES, rng)
    lens = rng.integers(1, SIZES["n_k"] + 1, size=(SIZES["batch"], 1))
    feed["valid_lens"] = np.ascontiguousarray(np.broadcast_to(lens, feed["valid_lens"].shape), dtype=np.int64)
    return feed


def process_main(kind: str, index: int, core: int, clients: list[int], args: argparse.Namespace,
                 shared: dict) -> None:
    """A process of `kind`: "workers" (its own session, one run at a time, a request each), "workers-batched"
    (the same, its clients' waiting requests joined into one run) or "front" (the engine's: each client's
    inputs in its slot, as a decode into shared memory would leave them). Its clients' threads send requests
    until the window ends; then their (end time, latency) and wrong answers go to the queue."""
    pin(core)
    model_dir = args.repository / "dot_product"
    own = session(model_dir, args.device) if kind != "front" else None
    reference = session(model_dir, "cpu")
    names = [o.name for o in (own or reference).get_outputs()]
    feeds = {c: feed_of(model_dir, c) for c in clients}
    expected = {c: reference.run(names, feeds[c]) for c in clients} if reference is not None else {}
    if own is not None:
        for _ in range(3):
            own.run(names, feeds[clients[0]])
    slots: Slots = shared["slots"]
    pipe = shared["requests"]
    if kind == "front":
        for c in clients:
            for name, array in feeds[c].items():
                np.copyto(slots.view(c, name), array)
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    answers = {c: (threading.Semaphore(0), [None]) for c in clients}
    batcher = threading.Thread(target=join_runs, args=(own, feeds, waiting, answers, shared["counts"],
                                                       kind == "workers-batched"), daemon=True)
    if kind != "front":
        batcher.start()
    records: dict[int, list[tuple[float, float]]] = {c: [] for c in clients}
    wrong = [0]
    shared["ready"].release()
    shared["go"].wait()
    end = shared["begin"].value + args.warmup + args.seconds

    def client(c: int) -> None:
        mine, n = records[c], 0
        while True:
            start = time.perf_counter()
            if kind != "front":
                waiting.put(c)
                answers[c][0].acquire()
                outputs = answers[c][1][0]
            else:  # read where the engine wrote them, as an encode would
                os.write(pipe[1], struct.pack("i", c))
                os.read(shared["answers"][c][0], 1)
                outputs = [slots.view(c, name) for name in names]
            now = time.time()
            mine.append((now, time.perf_counter() - start))
            if expected and n % CHECK_EVERY == 0 and not all(
                    np.allclose(got, want.reshape(got.shape), rtol=TOLERANCE, atol=TOLERANCE)
                    for got, want in zip(outputs, expected[c], strict=True)):
                wrong[0] += 1
            n += 1
            if now > end:
                return

    threads = [threading.Thread(target=client, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if batcher.is_alive():
        waiting.put(STOP)
        batcher.join()
    shared["results"].put((records, wrong[0]))


def joined(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One run's inputs: a request's own, or several requests' joined along the batch axis."""
    return feeds[0] if len(feeds) == 1 else {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}


def join_runs(own, feeds: dict[int, dict[str, np.ndarray]], waiting: queue.SimpleQueue, answers: dict,
              counts, batched: bool) -> None:
    """A worker's runner: the requests waiting, one run each (ATTEND_WORKERS with W2's largest requests:
    past ATTEND_MAX_BATCH_ELEMENTS a request runs alone) or joined into one run (`batched`); each client's
    outputs its rows (views)."""
    names, rows = [o.name for o in own.get_outputs()], SIZES["batch"]
    while True:
        group = [waiting.get()]
        with contextlib.suppress(queue.Empty):
            while batched:
                group.append(waiting.get_nowait())
        if STOP in group:
            return
        outputs = own.run(names, joined([feeds[c] for c in group]))
        for j, c in enumerate(group):
            answers[c][1][0] = [array[j * rows:(j + 1) * rows] for array in outputs]
            answers[c][0].release()
        with counts.get_lock():
            counts[0] += 1
            counts[1] += len(group)


def engine_main(cores: list[int], threads: int, batched: bool, args: argparse.Namespace, shared: dict) -> None:
    """The engine: the only session, and `threads` threads answering every front end's slots."""
    pin(cores)
    own = session(args.repository / "dot_product", args.device)
    names, inputs = [o.name for o in own.get_outputs()], [i.name for i in own.get_inputs()]
    for _ in range(3):
        own.run(names, {name: shared["slots"].view(0, name) for name in inputs})
    running = dispatch(own, shared["slots"], shared["requests"][0], shared, batched, threads)
    shared["ready"].release()
    for t in running:
        t.join()


def dispatch(own, slots: Slots, requests: int, shared: dict, batched: bool, threads: int) -> list[threading.Thread]:
    """`threads` threads that each take the slots waiting on the pipe `requests` (all of them where `batched`,
    else one), run them in one batch, and answer each, until a STOP; the runs and the requests they held are
    counted in shared["counts"]."""
    names, inputs = [o.name for o in own.get_outputs()], [i.name for i in own.get_inputs()]
    os.set_blocking(requests, False)
    counts, rows = shared["counts"], SIZES["batch"]
    most = len(shared["answers"]) if batched else 1

    def answer() -> None:
        while True:
            select.select([requests], [], [])
            try:
                data = os.read(requests, 4 * most)
            except BlockingIOError:  # another thread took them
                continue
            taken = struct.unpack(f"{len(data) // 4}i", data)
            if STOP in taken:
                return
            for group in ([taken] if batched else [[s] for s in taken]):
                outputs = own.run(names, joined([{name: slots.view(s, name) for name in inputs} for s in group]))
                for j, s in enumerate(group):
                    for name, array in zip(names, outputs, strict=True):
                        view = slots.view(s, name)  # model.onnx's weights have an axis of one head more
                        np.copyto(view, array[j * rows:(j + 1) * rows].reshape(view.shape))
                    os.write(shared["answers"][s][1], b"x")
                with counts.get_lock():
                    counts[0] += 1
                    counts[1] += len(group)

    def serve() -> None:
        try:
            answer()
        except BaseException:  # the clients would wait for good: the point fails instead
            import traceback

            traceback.print_exc()
            os._exit(1)

    started = [threading.Thread(target=serve, daemon=True) for _ in range(threads)]
    for t in started:
        t.start()
    return started


def point(mode: str, processes: int, args: argparse.Namespace) -> dict[str, Any]:
    """One mode at P processes: requests/s, p50 and p99 over the window, and how busy the cores and GPU were."""
    ctx = multiprocessing.get_context("fork")  # the pipes and the shared memory go with the processes
    cores = sorted(os.sched_getaffinity(0))
    front = cores[:processes] if len(cores) >= processes else [cores[i % len(cores)] for i in range(processes)]
    engine_cores = cores[processes:2 * processes] or cores[-1:]
    model_dir = args.repository / "dot_product"
    config = read_config(model_dir)
    feed = feed_of(model_dir, 0)
    arrays = {name: (a.shape, a.dtype) for name, a in feed.items()}
    for output in config.outputs:
        arrays[output["name"]] = (tuple(SIZES[d] if isinstance(d, str) else d for d in output["shape"]),
                                  np.dtype(output["dtype"]))
    slots = Slots(arrays, args.concurrency)
    for name, array in feed.items():  # the engine's warm-up runs slot 0
        np.copyto(slots.view(0, name), array)
    engine = mode.startswith("engine")
    shared = {"ready": ctx.Semaphore(0), "go": ctx.Event(), "begin": ctx.Value("d", 0.0, lock=False),
              "results": ctx.Queue(), "slots": slots, "requests": os.pipe(),
              "answers": [os.pipe() for _ in range(args.concurrency)], "counts": ctx.Array("q", 2)}
    clients = [list(range(args.concurrency))[i::processes] for i in range(processes)]
    started = []
    if engine:  # as many runs at once as the workers would have
        started.append(ctx.Process(target=engine_main, args=(engine_cores, processes, mode == "engine-batched", args,
                                                             shared), daemon=True))
    started += [ctx.Process(target=process_main, args=("front" if engine else mode, i, front[i], clients[i], args,
                                                       shared), daemon=True)
                for i in range(processes)]
    for p in started:
        p.start()
    for _ in started:
        if not shared["ready"].acquire(timeout=180):
            raise SystemExit(f"{mode} at {processes}: a process did not get ready")
    busy = {"processes": sorted(set(front))} | ({"engine": engine_cores} if engine else {})
    sampler = Sampler(busy, args.device == "cuda")
    try:
        shared["begin"].value = time.time()
        shared["go"].set()
        records, wrong, waited = {}, 0, 0
        while waited < processes:
            try:
                got, bad = shared["results"].get(timeout=1)
            except queue.Empty:
                failed = [p.exitcode for p in started if p.exitcode not in (None, 0)]
                if failed or time.time() > shared["begin"].value + args.warmup + args.seconds + 120:
                    raise SystemExit(f"{mode} at {processes}: a process failed ({failed}) or hung") from None
                continue
            records.update(got)
            wrong += bad
            waited += 1
        begin = shared["begin"].value + args.warmup
        end = begin + args.seconds
        window = sampler.window(begin, end)
    finally:
        sampler.close()
        if engine:
            for _ in range(processes):
                os.write(shared["requests"][1], struct.pack("i", STOP))
        for p in started:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for fd in (fd for pair in (shared["requests"], *shared["answers"]) for fd in pair):
            os.close(fd)
        slots.close()
    inside = [latency for rows in records.values() for t, latency in rows if begin <= t <= end]
    counts = shared["counts"]
    latencies = sorted(inside)
    return {"mode": mode, "processes": processes, "concurrency": args.concurrency, "requests": len(inside),
            "rps": round(len(inside) / args.seconds, 1),
            "p50_ms": round(latencies[len(latencies) // 2] * 1e3, 3) if latencies else None,
            "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3, 3)
            if latencies else None,
            "batch": round(counts[1] / counts[0], 2) if counts[0] else None,
            "wrong": wrong, "cores": busy} | window


def render(results: dict) -> list[str]:
    head = "| mode | processes | c | requests/s | x workers alike | p50 ms | p99 ms | requests a run | " \
           "cores busy (processes, engine) | GPU util % |"
    placed = {p["processes"]: p["cores"] for p in results["points"] if "engine" in p["cores"]}
    where = "; ".join(f"{n}: processes on cores {_cores(c['processes'])}, the engine on {_cores(c['engine'])}"
                      for n, c in placed.items())
    lines = [f"Dot-product, batch {SIZES['batch']} x {SIZES['n_q']} x {SIZES['n_k']} x {SIZES['d']} a request, "
             f"outputs and weights; {results['settings']['concurrency']} clients; "
             f"{results['settings']['seconds']:g} s a point after {results['settings']['warmup']:g} s of warm-up. "
             f"Cores ({where}).", "", head,
             "| --- | ---: |" + " ---: |" * (head.count("|") - 3)]
    by = {(p["mode"], p["processes"]): p for p in results["points"]}
    for p in results["points"]:
        base = by.get((_alike(p["mode"]), p["processes"]))
        engine_busy = p.get("engine_busy")
        lines.append(" | ".join([
            f"| {p['mode']}", str(p["processes"]), str(p["concurrency"]), f"{p['rps']:.0f}",
            f"{p['rps'] / base['rps']:.2f}x" if base and base["rps"] else "-",
            f"{p['p50_ms']:.2f}" if p["p50_ms"] is not None else "-",
            f"{p['p99_ms']:.2f}" if p["p99_ms"] is not None else "-",
            f"{p['batch']:.1f}" if p.get("batch") else "-",
            (f"{p['processes_busy']:.0%}" if p.get("processes_busy") is not None else "-")
            + (f", {engine_busy:.0%}" if engine_busy is not None else ""),
            f"{p['gpu_util']:.0f}" if p.get("gpu_util") is not None else "-"]) + " |")
    top = max(results["settings"]["processes"])
    served = by.get(("workers", top))  # the design as the service runs it
    ratios = [f"{mode} {by[(mode, top)]['rps'] / served['rps']:.2f}x" for mode in MODES[1:]
              if (mode, top) in by and served and served["rps"]]
    wrong = sum(p["wrong"] for p in results["points"])
    lines += ["", f"Wrong answers (each client's first and every {CHECK_EVERY}th, against its own CPU session's): "
              f"{wrong}.", f"requests/s at {top} processes against workers (ATTEND_WORKERS): " + ", ".join(ratios)]
    return lines


def _alike(mode: str) -> str:
    """The workers' mode an engine's is weighed against: the same batching."""
    return "workers-batched" if mode.endswith("batched") else "workers"


def _cores(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--processes", default="1,8")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--results", type=Path, help="default: docs/engine-<device>.json")
    parser.add_argument("--report", action="store_true", help="print (and --out) the table of --results")
    parser.add_argument("--out", type=Path, help="write the table into this file's <!-- engine-<device> --> section")
    args = parser.parse_args()
    if args.results is None:
        if args.report:
            parser.error("--report needs --results")
        args.results = ROOT / "docs" / f"engine-{args.device}.json"
    if not args.report:
        args.repository = args.repository.resolve()
        processes = [int(x) for x in args.processes.split(",")]
        results = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   "command": " ".join(["python bench/engine.py", *sys.argv[1:]]), "machine": machine(args.device),
                   "settings": {"device": args.device, "processes": processes, "concurrency": args.concurrency,
                                "seconds": args.seconds, "warmup": args.warmup, "sizes": SIZES},
                   "points": []}
        for n in processes:
            for mode in args.modes.split(","):
                print(f"{mode} at {n} processes ...", file=sys.stderr)
                results["points"].append(point(mode, n, args))
                args.results.write_text(json.dumps(results, indent=1) + "\n")
    results = json.loads(args.results.read_text())
    lines = render(results)
    print("\n".join(lines))
    if args.out:
        from tests.load.report import write_section

        write_section(args.out, f"engine-{results['settings']['device']}", lines, stamp=results["date"],
                      command=results["command"],
                      where=results["machine"])
    return 1 if any(p["wrong"] for p in results["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
