"""Many cores, one GPU: the service at 1, 2, 4 and 8 worker processes (ATTEND_WORKERS, each with its own
ONNX Runtime session), and the plain server (bench/plain_server.py) with as many uvicorn workers beside it.

    python bench/scaling.py [--device both] [--processes 1,2,4,8] [--rows W1,W2bin,W1grpc] [--duration 2]
                            [--rounds 1] [--concurrency 16] [--largest-concurrency 64] [--budget S]
                            [--results docs/scaling.json] [--out docs/benchmarks.md]
    python bench/scaling.py --report [--results docs/scaling.json] [--out docs/benchmarks.md]

Rows and pools are `make bench`'s (bench/pools.py): W1 (POST /attend JSON), W2bin (the Open Inference
Protocol's binary tensors), W1grpc (gRPC ModelInfer); the load generator is bench/loadgen.py's (wrk with
bench/pool.lua, bench/grpc_load.py's processes), every request timed. Cores: with P the largest process
count, the service's N processes on cores 0..N-1 (taskset; one ONNX Runtime intra-op thread each) and the
load generator on cores P..2P-1 of its own; on a machine with fewer than 2P cores the load takes the cores
the service does not, and shares them where there are none (the output says so). Each process count starts
both servers once (at once, on the same cores), on each device (--device: cuda, cpu or both; default both
where nvidia-smi and ONNX Runtime's CUDA provider are there, else cpu), and measures every row on them, a
server at a time, after --warmup seconds of load on each row: each point at --concurrency,
and at the largest count also at --largest-concurrency (the issue's p99 goal: c=64 with 8 processes against
c=16 with 1). Beside each point: medians over --rounds of requests/s, p50 and p99; how busy the service's
and the load's cores were (/proc/stat, over the point's window), and from that the load generator's own
ceiling (its requests/s over its cores' busy fraction); the requests each worker served (its
attend_worker_served); on CUDA the GPU's utilization and memory (nvidia-smi every 100 ms). Each server's
processes: their resident memory and GPU memory (nvidia-smi's compute apps, where it names their pids; and
what the GPU's memory grew by while both servers started).

The results go to --results (rewritten after every point: a sweep cut short keeps what it measured),
`--report` prints the table from that file and ends with one line, `scaling at P: W1 <x>x, ...`: each
row's requests/s at the largest count (the higher of its concurrencies) over the same row at 1 process.
--out writes the report into that file's <!-- scaling --> section. --budget stops starting points after so
many seconds (the sweep ends with what it has). SIGTERM stops the servers before the script exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grpc_floor import core_times  # noqa: E402
from loadgen import measure  # noqa: E402
from pools import ROWS, SEED, TRANSPORTS, WORKLOADS, make_pools  # noqa: E402
from run import PLAIN, machine, service_env  # noqa: E402

from tests.load.report import write_section  # noqa: E402
from tests.server import children, free_port, running_service, served_by_worker  # noqa: E402

DEFAULT_ROWS = ("W1", "W2bin", "W1grpc")
SAMPLE_S = 0.1


def cuda_here() -> bool:
    """A GPU nvidia-smi sees and ONNX Runtime's CUDA provider."""
    import onnxruntime

    return shutil.which("nvidia-smi") is not None and "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def layout(processes: list[int]) -> dict[int, dict]:
    """For each process count N: the service's cores, the load generator's, and whether they share any."""
    cores = sorted(os.sched_getaffinity(0))
    largest = max(processes)
    if largest > len(cores):
        raise SystemExit(f"{largest} processes need {largest} cores; this process may use {len(cores)}")
    out = {}
    for n in processes:
        service = cores[:n]
        if len(cores) >= 2 * largest:
            load = cores[largest:2 * largest]  # the same cores for every count
        else:
            load = cores[n:] or cores
        out[n] = {"service_cores": service, "load_cores": load, "shared": bool(set(service) & set(load))}
    return out


def cpu_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


# --------------------------------------------------------------------------------------------- servers

def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def wait_for_workers(url: str, n: int, timeout: float) -> None:
    """Until /metrics counts N live workers and all of them ready (attend_ready is the least of them)."""
    if n == 1:
        return  # running_service waited for /health/ready, and one process has no worker metrics
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = metrics(url)
        ready = re.search(r"^attend_ready (\S+)", text, re.M)
        if len(served_by_worker(text)) == n and ready and float(ready.group(1)) == 1:
            return
        time.sleep(0.3)
    raise RuntimeError(f"the service's {n} workers were not all ready in {timeout:.0f} s")


def wait_for_plain(log_path: Path, n: int, timeout: float) -> None:
    """Until each of uvicorn's N workers said its application started (their models load at import)."""
    deadline = time.monotonic() + timeout
    while log_path.read_text().count("Application startup complete.") < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the plain server's {n} workers did not all start in {timeout:.0f} s: "
                               + log_path.read_text()[-2000:])
        time.sleep(0.3)


def plain_command(n: int) -> list[str]:
    """bench/run.py's plain server with N uvicorn workers; uvicorn's info log (one line a worker's start),
    no access log."""
    return [*("info" if part == "warning" else part for part in PLAIN), "--workers", str(n), "--no-access-log"]


def start(stack: contextlib.ExitStack, kind: str, device: str, n: int, cores: list[int], repository: Path,
          folder: Path) -> dict:
    """The service ("service") or the plain server ("plain") with N processes on `cores`, on `device`, up and
    every process ready: {"kind", "url", "port", "grpc_port", "proc", "startup_s"}."""
    began = time.monotonic()
    prefix = ("taskset", "-c", cpu_list(cores))
    log_path = folder / f"{kind}-{device}-{n}.log"
    if kind == "plain":
        url, proc = stack.enter_context(running_service(
            repository, timeout=180, prefix=prefix, command=plain_command(n), ready_path="/docs",
            log_path=log_path, PLAIN_REPOSITORY=str(repository), PLAIN_DEVICE=device))
        wait_for_plain(log_path, n, 180)
        grpc_port = 0
    else:
        grpc_port = free_port()
        url, proc = stack.enter_context(running_service(repository, timeout=180, prefix=prefix, log_path=log_path,
                                                        **service_env(True, {
                                                            "ATTEND_WORKERS": str(n), "ATTEND_DEVICE": device,
                                                            "ATTEND_GRPC_PORT": str(grpc_port)})))
        wait_for_workers(url, n, 180)
    return {"kind": kind, "url": url, "port": int(url.rsplit(":", 1)[1]), "grpc_port": grpc_port, "proc": proc,
            "startup_s": round(time.monotonic() - began, 1), "log": log_path}


def stop_together(servers: dict[str, dict]) -> None:
    """SIGTERM to every server at once (each one's context then waits for its own exit)."""
    for server in servers.values():
        if server["proc"].poll() is None:
            server["proc"].send_signal(signal.SIGTERM)


def processes_of(server: dict) -> dict[str, list[int]]:
    """The server's supervisor (the process started) and its workers (one process: itself); not the
    supervisor's other children (multiprocessing's resource tracker)."""
    pid = server["proc"].pid
    workers = []
    for child in children(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.append(child)
    return {"supervisor": [pid] if workers else [], "workers": workers or [pid]}


def rss_mib(pid: int) -> float | None:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return round(int(line.split()[1]) / 1024, 1)


def gpu_used_mib() -> float | None:
    out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return float(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def gpu_memory_by_pid() -> dict[int, float]:
    """GPU memory of each process nvidia-smi lists (none where it cannot see this machine's pids)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    found = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                found[int(parts[0])] = float(parts[1])
    return found


def memory(server: dict, gpu: bool) -> dict:
    """Each process's resident memory and (on CUDA, where nvidia-smi names it) GPU memory, in MiB."""
    pids = processes_of(server)
    by_pid = gpu_memory_by_pid() if gpu else {}
    out: dict = {"workers": len(pids["workers"])}
    for role, listed in pids.items():
        out[f"{role}_rss_mib"] = [rss_mib(p) for p in listed]
        if gpu:
            out[f"{role}_gpu_mib"] = [by_pid.get(p) for p in listed]
    return out


def choices(url: str, rows: list[str]) -> dict[str, str]:
    """The rows' models' choice of graphs (GET /models/{name}'s graphs; every worker's is the start's check's),
    as the service's log writes it, where the warm-up timed them."""
    out = {}
    for model in dict.fromkeys(WORKLOADS[ROWS[row][0]].text.split(",")[0] for row in rows):
        response = httpx.get(f"{url}/models/{model}", timeout=30)
        if response.status_code == 200 and response.json().get("graph_timings"):
            out[model] = describe_graphs(response.json()["graphs"])
    return out


def describe_graphs(graphs: list[dict]) -> str:
    def one(weights: bool) -> str:
        return ", then ".join(f"{g['file']} on {'CUDA' if 'CUDA' in g['provider'] else 'CPU'}" + (
            f" up to {g['up_to_elements']} elements" if g["up_to_elements"] is not None else "")
            for g in graphs if g["weights"] is weights)
    return f"with the weights: {one(True)}; without: {one(False)}"


# -------------------------------------------------------------------------------------------- sampling

class Sampler:
    """During a point: /proc/stat's jiffies of the given cores, and on CUDA nvidia-smi's utilization and
    memory, every 100 ms, each sample with its time (time.time())."""

    def __init__(self, cores: dict[str, list[int]], gpu: bool):
        self.cores, self.gpu = cores, gpu
        self.cpu: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self.gpu_samples: list[tuple[float, float, float]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._cpu, daemon=True)]
        self.smi: subprocess.Popen | None = None
        if gpu:
            # Its own timestamp on each line: a pipe may hand the lines over late.
            self.smi = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-gpu=timestamp,utilization.gpu,memory.used",
                                         "--format=csv,noheader,nounits", "-lms", str(int(SAMPLE_S * 1000))],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
            self.threads.append(threading.Thread(target=self._gpu, daemon=True))
        for t in self.threads:
            t.start()

    def _cpu(self) -> None:
        while not self.stop.is_set():
            sample = {}
            for name, cores in self.cores.items():
                times = [core_times(c) for c in cores]
                sample[name] = (sum(t[0] for t in times), sum(t[1] for t in times))
            self.cpu.append((time.time(), sample))
            self.stop.wait(SAMPLE_S)

    def _gpu(self) -> None:
        assert self.smi is not None and self.smi.stdout is not None
        for line in self.smi.stdout:
            parts = [p.strip() for p in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time
                self.gpu_samples.append((when, float(parts[1]), float(parts[2])))

    def close(self) -> None:
        self.stop.set()
        if self.smi is not None:
            self.smi.terminate()
            self.smi.wait(timeout=10)
        for t in self.threads:
            t.join(timeout=10)

    def window(self, begin: float, end: float) -> dict:
        """How busy each set of cores was from `begin` to `end` (the samples nearest them), and the GPU's
        mean and peak utilization and peak memory over the samples within."""
        out: dict = {}
        inside = [s for s in self.cpu if begin <= s[0] <= end]
        if len(inside) >= 2:
            first, last = inside[0][1], inside[-1][1]
            for name in self.cores:
                total = last[name][0] - first[name][0]
                out[f"{name}_busy"] = round(1 - (last[name][1] - first[name][1]) / total, 3) if total > 0 else None
        gpu = [s for s in self.gpu_samples if begin <= s[0] <= end]
        if gpu:
            out["gpu_util"] = round(statistics.fmean(s[1] for s in gpu), 1)
            out["gpu_util_max"] = max(s[1] for s in gpu)
            out["gpu_mib"] = max(s[2] for s in gpu)
        return out


# ---------------------------------------------------------------------------------------- measurement

def point(server: dict, row: str, index: Path, c: int, seconds: float, cores: dict, gpu: bool) -> dict:
    """One point: the load for `seconds` (the load generator on cores["load"]), with the samples of its
    window and, for the service with workers, the requests each worker served."""
    client = TRANSPORTS[ROWS[row][1]].client
    port = server["grpc_port"] if client == "grpc" else server["port"]
    before = served_by_worker(metrics(server["url"])) if server["kind"] == "service" else {}
    sampler = Sampler({"service": cores["service"], "load": cores["load"]}, gpu)
    try:
        measured = measure(client, port, index, c, seconds, load_cpu=cpu_list(cores["load"]))
        ended = time.time()
    finally:
        sampler.close()
    record: dict = {"requests": measured.requests, "seconds": round(measured.seconds, 3),
                    "rps": round(measured.rps, 1) if measured.seconds else 0.0,
                    "p50_ms": round(measured.percentile(50), 3) if measured.requests else None,
                    "p99_ms": round(measured.percentile(99), 3) if measured.requests else None}
    # The load ran for its `seconds` just before it returned, less its own end (wrk's: milliseconds; gRPC's
    # processes': a few hundred): the samples from a little after its start to a little before its end.
    record |= sampler.window(ended - measured.seconds + 0.1, ended - 0.4)
    if record.get("load_busy"):
        record["load_ceiling_rps"] = round(measured.rps / record["load_busy"])
    if not measured.ok:
        record["failed"] = {"statuses": measured.statuses, "errors": measured.errors}
    if before:
        after = served_by_worker(metrics(server["url"]))
        record["per_worker_rps"] = sorted(round((after.get(pid, 0) - before.get(pid, 0)) / measured.seconds, 1)
                                          for pid in after)
    return record


def run(args: argparse.Namespace) -> dict:
    devices = ["cuda", "cpu"] if args.device == "both" else [args.device]
    processes = sorted(int(n) for n in args.processes.split(","))
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    largest_extra = [args.largest_concurrency] if args.largest_concurrency and \
        args.largest_concurrency not in concurrency else []
    cores = layout(processes)
    for n in processes:
        shared = " (shared with the service: this machine has too few cores to keep them apart)" \
            if cores[n]["shared"] else ""
        print(f"{n} processes: the service on cores {cpu_list(cores[n]['service_cores'])}, the load generator on "
              f"{cpu_list(cores[n]['load_cores'])}{shared}", file=sys.stderr)
    clock = time.monotonic()
    started = datetime.datetime.now(datetime.UTC)
    results = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python bench/scaling.py", *sys.argv[1:]]),
        "machine": machine("cuda" if "cuda" in devices else "cpu") + ("; both execution providers"
                                                                       if len(devices) == 2 else ""),
        "settings": {"devices": devices, "processes": processes, "rows": rows, "concurrency": concurrency,
                     "largest_concurrency": args.largest_concurrency or None, "rounds": args.rounds,
                     "duration_s": args.duration, "warmup_s": args.warmup, "seed": args.seed,
                     "layout": {str(n): v for n, v in cores.items()}, "budget_s": args.budget},
        "rows": {row: {"workload": ROWS[row][0], "transport": ROWS[row][1], "text": WORKLOADS[ROWS[row][0]].text,
                       "transport_text": TRANSPORTS[ROWS[row][1]].text} for row in rows},
        "servers": [], "points": [], "skipped": [], "seconds": 0.0,
    }

    def save() -> None:
        results["seconds"] = round(time.monotonic() - clock, 1)
        if args.results:
            tmp = args.results.with_name(args.results.name + ".tmp")
            tmp.write_text(json.dumps(results, indent=1) + "\n")
            tmp.replace(args.results)

    def elapsed() -> float:
        return time.monotonic() - clock

    tmp = Path(tempfile.mkdtemp(prefix="attend-scaling-"))
    try:
        print(f"pools of bodies (seed {args.seed}) ...", file=sys.stderr)
        pools = make_pools(tmp, rows, args.seed)
        for device in devices:
            for n in processes:
                if args.budget and elapsed() > args.budget:
                    results["skipped"].append({"device": device, "processes": n, "why": "budget"})
                    continue
                extra = largest_extra if n == processes[-1] else []
                try:
                    sweep_count(args, results, pools, device, n, cores[n], concurrency + extra, tmp, save, elapsed)
                except Exception as e:  # a server that would not start: the sweep goes on without this count
                    results["servers"].append({"device": device, "processes": n,
                                               "error": f"{type(e).__name__}: {str(e)[:1000]}"})
                    print(f"{device} {n} processes: {results['servers'][-1]['error']}", file=sys.stderr)
                save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save()
    return results


def sweep_count(args: argparse.Namespace, results: dict, pools: dict, device: str, n: int, cores: dict,
                concurrency: list[int], folder: Path, save, elapsed) -> None:
    """Both servers at N processes on `device`, started once, and every row at every concurrency on them."""
    gpu = device == "cuda"
    here = {"service": cores["service_cores"], "load": cores["load_cores"]}
    os.sched_setaffinity(0, here["load"])  # this process (its samplers, its waits) off the service's cores
    with contextlib.ExitStack() as stack:
        # Both servers start at once (each on its own stack, closed with this one whatever happens to the other).
        kinds_started = ("service",) if args.no_plain else ("service", "plain")
        print(f"{device} {n} processes: starting {' and '.join(kinds_started)} ...", file=sys.stderr)
        base = gpu_used_mib() if gpu else None
        stacks = {kind: stack.enter_context(contextlib.ExitStack()) for kind in kinds_started}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = {kind: pool.submit(start, stacks[kind], kind, device, n, here["service"], args.repository,
                                         folder) for kind in stacks}
            done, pending = concurrent.futures.wait(started.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
            if pending and any(future.exception() for future in done):
                # One failed: the other is not waited for (uvicorn restarts a plain worker that fails at import
                # for good, and its readiness would be waited for minutes).
                for pid in children(os.getpid()):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGTERM)
        servers = {kind: future.result() for kind, future in started.items()}
        used = gpu_used_mib() if base is not None else None
        for kind, server in servers.items():
            server["entry"] = {"device": device, "processes": n, "server": kind, "startup_s": server["startup_s"],
                               "at_start": memory(server, gpu)}
            if used is not None and base is not None:
                server["entry"]["gpu_mib_added_both"] = round(used - base, 1)
            if kind == "service":
                server["entry"]["graphs"] = choices(server["url"], results["settings"]["rows"])
            results["servers"].append(server["entry"])
        stack.callback(stop_together, servers)  # first on the way out: the servers drain at once
        warmed: set[tuple[str, str]] = set()
        for rnd in range(args.rounds):
            for row in results["settings"]["rows"]:
                transport = TRANSPORTS[ROWS[row][1]]
                kinds = ["service", "plain"] if transport.plain and not args.no_plain else ["service"]
                for c in concurrency:
                    for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                        key = {"device": device, "processes": n, "row": row, "concurrency": c, "server": kind,
                               "round": rnd}
                        if args.budget and elapsed() > args.budget:
                            results["skipped"].append(key | {"why": "budget"})
                            continue
                        key["at_s"] = round(elapsed(), 1)  # when it began, from the sweep's start
                        print(f"[{rnd + 1}/{args.rounds}] {device} {n} processes {row} c={c} {kind} ...",
                              file=sys.stderr)
                        index = pools[row]["index"]
                        try:
                            if args.warmup > 0 and (kind, row) not in warmed:
                                port = servers[kind]["grpc_port" if transport.client == "grpc" else "port"]
                                measure(transport.client, port, index, c, args.warmup, load_cpu=cpu_list(here["load"]))
                                warmed.add((kind, row))
                            record = point(servers[kind], row, index, c, args.duration, here, gpu)
                        except Exception as e:  # the sweep goes on; the point says what went wrong
                            record = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                        results["points"].append(key | record)
                        save()
        for server in servers.values():
            server["entry"]["at_end"] = memory(server, gpu)


# ---------------------------------------------------------------------------------------------- report

def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(results: dict) -> dict[tuple, dict]:
    """(device, processes, row, concurrency, server) -> the medians over the rounds of every figure."""
    groups: dict[tuple, list[dict]] = {}
    for p in results["points"]:
        if "error" in p or "failed" in p or not p.get("requests"):
            continue
        groups.setdefault((p["device"], p["processes"], p["row"], p["concurrency"], p["server"]), []).append(p)
    out = {}
    for key, runs in groups.items():
        med = {k: _median([r.get(k) for r in runs]) for k in ("rps", "p50_ms", "p99_ms", "service_busy", "load_busy",
                                                                "load_ceiling_rps", "gpu_util", "gpu_mib")}
        spread = [r["per_worker_rps"] for r in runs if r.get("per_worker_rps")]
        if spread:
            med["per_worker"] = (min(min(s) for s in spread), max(max(s) for s in spread))
        med["rounds"] = len(runs)
        out[key] = med
    return out


def scaling(results: dict, device: str) -> tuple[int, dict[str, float | None]]:
    """(the largest count measured, each row's requests/s there (the higher of its concurrencies) over
    its requests/s at 1 process (at the base concurrency))."""
    summary = summarise(results)
    base_c = results["settings"]["concurrency"][0]
    counts = sorted({k[1] for k in summary if k[0] == device and k[4] == "service"})
    largest = counts[-1] if counts else 0
    out: dict[str, float | None] = {}
    for row in results["settings"]["rows"]:
        one = summary.get((device, 1, row, base_c, "service"))
        top = [m["rps"] for k, m in summary.items() if k[:3] == (device, largest, row) and k[4] == "service"]
        out[row] = round(max(top) / one["rps"], 2) if one and top and one["rps"] else None
    return largest, out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def render(results: dict) -> list[str]:
    """The report: a table of every point (medians over the rounds), the servers' memory, the p99 goal's
    figures and, last, the one line of scaling."""
    summary = summarise(results)
    settings = results["settings"]
    base_c = settings["concurrency"][0]
    lines = []
    shared = [n for n, v in settings["layout"].items() if v["shared"]]
    layout_text = "; ".join(f"{n}: service on cores {cpu_list(v['service_cores'])}, load on "
                            f"{cpu_list(v['load_cores'])}" for n, v in settings["layout"].items())
    sharing = (f"; at {', '.join(shared)} processes the load generator shares the service's cores (too few cores "
               "here), so its busy and ceiling columns count both") if shared else ""
    lines += [f"Processes and cores ({layout_text}){sharing}. {settings['rounds']} round(s) of "
              f"{settings['duration_s']:g} s a point after {settings['warmup_s']:g} s of warm-up; the sweep took "
              f"{results['seconds']:.0f} s.", ""]
    head = ("| device | row | processes | c | service req/s | x 1 process | p50 ms | p99 ms | req/s a worker "
            "(min-max) | service cores busy | load cores busy | load ceiling req/s | GPU util % | GPU MiB | "
            "plain req/s | x plain |")
    lines += [head, "| --- | --- | ---: |" + " ---: |" * (head.count("|") - 4)]
    keys = sorted({k[:4] for k in summary if k[4] == "service"},
                  key=lambda k: (settings["devices"].index(k[0]), settings["rows"].index(k[2]), k[1], k[3]))
    for device, n, row, c in keys:
        m = summary[(device, n, row, c, "service")]
        one = summary.get((device, 1, row, base_c, "service"))
        plain = summary.get((device, n, row, c, "plain"))
        spread = m.get("per_worker")
        cells = [device, row, str(n), str(c), _fmt(m["rps"], ".0f"),
                 _fmt(m["rps"] / one["rps"] if one and one["rps"] else None, ".2f", "x"),
                 _fmt(m["p50_ms"], ".2f"), _fmt(m["p99_ms"], ".2f"),
                 f"{spread[0]:.0f}-{spread[1]:.0f}" if spread else "-",
                 _fmt(m["service_busy"], ".0%"), _fmt(m["load_busy"], ".0%"), _fmt(m["load_ceiling_rps"], ".0f"),
                 _fmt(m["gpu_util"], ".0f"), _fmt(m["gpu_mib"], ".0f"),
                 _fmt(plain["rps"] if plain else None, ".0f"),
                 _fmt(m["rps"] / plain["rps"] if plain and plain["rps"] else None, ".2f", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [p for p in results["points"] if "error" in p or "failed" in p]
    if failed:
        lines += ["", f"{len(failed)} point(s) failed: " + "; ".join(
            f"{p['device']} {p['processes']} {p['row']} c={p['concurrency']} {p['server']}: "
            f"{p.get('error') or p.get('failed')}" for p in failed[:5])]
    if results.get("skipped"):
        lines += ["", f"{len(results['skipped'])} point(s) or counts not run (--budget spent)."]

    memory_head = "| device | server | processes | started in s | resident MiB a worker | supervisor MiB | " \
                  "GPU MiB a worker | supervisor GPU MiB | GPU MiB both servers added |"
    lines += ["", "Each server's processes after the count's points (GPU MiB: nvidia-smi's per process, where it "
              "names their pids; and what the GPU's memory grew by while both servers started, at once):", "",
              memory_head, "| --- | --- | ---: |" + " ---: |" * (memory_head.count("|") - 4)]
    for s in results["servers"]:
        if "error" in s:
            lines.append(f"| {s['device']} | did not start | {s['processes']} | {s['error'][:300]} |")
            continue
        end = s.get("at_end") or s["at_start"]
        gpu_workers = [g for g in end.get("workers_gpu_mib", []) if g is not None]
        supervisor_gpu = [g for g in end.get("supervisor_gpu_mib", []) if g is not None]
        rss = [r for r in end.get("workers_rss_mib", []) if r is not None]
        supervisor = [r for r in end.get("supervisor_rss_mib", []) if r is not None]
        lines.append(f"| {s['device']} | {s['server']} | {s['processes']} | {s['startup_s']:.1f} | "
                     f"{_fmt(_median(rss), '.0f')} | {_fmt(supervisor[0] if supervisor else None, '.0f')} | "
                     f"{_fmt(_median(gpu_workers), '.0f')} | "
                     f"{_fmt(supervisor_gpu[0] if supervisor_gpu else None, '.0f') if s['device'] == 'cuda' else '-'}"
                     f" | {_fmt(s.get('gpu_mib_added_both'), '.0f')} |")

    chosen = [(s, model, text) for s in results["servers"] for model, text in (s.get("graphs") or {}).items()]
    if chosen:
        lines += ["", "The service's choice of graphs (`GET /models/{name}`, timed by the start's check; every "
                  "worker runs the same):", "", "| device | processes | model | graphs by a batch's elements |",
                  "| --- | ---: | --- | --- |"]
        lines += [f"| {s['device']} | {s['processes']} | {model} | {text} |" for s, model, text in chosen]

    device = "cuda" if "cuda" in settings["devices"] and any(k[0] == "cuda" for k in summary) else \
        settings["devices"][-1]
    largest, ratios = scaling(results, device)
    top_c = settings.get("largest_concurrency")
    one = {row: summary.get((device, 1, row, base_c, "service")) for row in settings["rows"]}
    top = {row: summary.get((device, largest, row, top_c, "service")) for row in settings["rows"]} if top_c else {}
    p99 = [f"{row} {_fmt(top[row]['p99_ms'], '.2f')} ms against {_fmt(one[row]['p99_ms'], '.2f')} ms"
           for row in settings["rows"] if top.get(row) and one.get(row)]
    lines += [""]
    if p99:
        lines.append(f"p99 at c={top_c} with {largest} processes against c={base_c} with 1 ({device}): "
                     + ", ".join(p99))
    lines.append(f"Requests/s at {largest} processes (the higher of its concurrencies) over 1 process at c={base_c}, "
                 f"{'ONNX Runtime CUDA' if device == 'cuda' else 'the CPU'} execution provider:")
    lines.append(f"scaling at {largest}: " + ", ".join(f"{row} {_fmt(x, '.2f', 'x')}" for row, x in ratios.items()))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu", "both"), default=None,
                        help="execution providers swept (default: both where there is a GPU, else cpu)")
    parser.add_argument("--processes", default="1,2,4,8", help="process counts (each server's workers)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"rows (bench/pools.py): {', '.join(ROWS)}")
    parser.add_argument("--concurrency", default="16", help="connections at every count (the first: the base)")
    parser.add_argument("--largest-concurrency", type=int, default=64,
                        help="connections at the largest count too (0: none)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds a point (whole seconds for wrk)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before a server's first point "
                        "on a row (0: none)")
    parser.add_argument("--budget", type=float, default=0, help="start no point after this many seconds (0: none)")
    parser.add_argument("--no-plain", action="store_true", help="the service alone (a second sweep of settings)")
    parser.add_argument("--seed", type=int, default=SEED, help="the pools' seed")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "scaling.json")
    parser.add_argument("--report", action="store_true", help="measure nothing: the report of --results")
    parser.add_argument("--out", type=Path, help="a markdown file with a <!-- scaling --> section (docs/benchmarks.md)")
    parser.add_argument("--section", default="scaling", help="the section of --out to write (default: %(default)s)")
    args = parser.parse_args()
    if args.report:
        if not args.results.exists():
            print(f"no results at {args.results}: run `python bench/scaling.py` first (on a GPU host: "
                  "--device both)", file=sys.stderr)
            return 1
        results = json.loads(args.results.read_text())
    else:
        if shutil.which("wrk") is None:
            print("wrk is needed: apt-get install wrk (make tools)", file=sys.stderr)
            return 2
        args.device = args.device or ("both" if cuda_here() else "cpu")
        # `timeout` and the like end the sweep with SIGTERM: the servers are stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        results = run(args)
        print(f"the sweep took {results['seconds']:.0f} s", file=sys.stderr)
    lines = render(results)
    if args.out:
        write_section(args.out, args.section, lines, stamp=results["date"], command=results["command"],
                      where=results["machine"])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
