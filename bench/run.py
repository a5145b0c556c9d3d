"""`make bench`: the service against the plain server a user could write instead (bench/plain_server.py),
on pools of varied bodies, over HTTP, from outside.

    python bench/run.py [--rounds 3] [--duration 3] [--rows W1,W3,W1r] [--results docs/benchmarks.json]
                        [--out docs/benchmarks.md] [--headline README.md]                      (make bench)
    python bench/run.py --report docs/benchmarks.json --out docs/benchmarks.md --headline README.md

What it sends (bench/pools.py): for each kind the default repository serves, a pool of bodies drawn
from a seeded RNG (values, valid-length forms, shapes), made once a run and sent to both servers; and
three bodies replayed (rows W1r-W3r, what this benchmark measured before). The load generator
(bench/loadgen.py: wrk with bench/pool.lua, one thread a connection, pinned to core 1) sends a
different body a request and times each request. Both servers run for the whole run, each pinned to
core 0 with one ONNX Runtime thread (the one measured alone has the core: the other is idle); they
alternate point by point: in round r, for each row and concurrency, the plain server then the service,
the other way round in odd rounds. It prints, for each row and concurrency, medians over the rounds of
requests/s, p50 and p99 (of every request's time), the server's CPU time a request, and the service's
throughput and p99 as multiples of the plain server's (the median of the per-round ratios).

The results go to a JSON file (--results); the report (tables, the run's date, machine and command)
is written from it into the marked sections of --out (`<!-- bench -->`), --readme (`<!-- bench-ratios -->`,
the ratios alone) and --headline (`<!-- bench-headline -->`, the README's one figure: W1 at the highest
concurrency, the service's requests/s beside the plain server's), at the end of a run or later with --report.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from loadgen import LOAD_CPU, measure  # noqa: E402
from pools import DEFAULT_ROWS, FRONT_DOORS, ROWS, SEED, TRANSPORTS, WORKLOADS, make_pools, v2_binary  # noqa: E402

from tests.load.report import write_section  # noqa: E402
from tests.server import free_port, proc_stat, running_service  # noqa: E402

SERVER_CPU = 0
PIN = ("taskset", "-c", str(SERVER_CPU))
LABELS = {"plain": "plain", "on": "service", "off": "service, batching off"}
SERVERS = {"plain": "plain", "service": "on", "service-nobatch": "off"}


def workloads() -> dict[str, tuple[str, dict]]:
    """The replayed bodies (W1-W3 of the scripts that import this: bench/ab.py's --replayed, breakdown.py,
    http_floor.py, ...): name -> (description, body)."""
    return {name: (WORKLOADS[f"{name}r"].text, WORKLOADS[f"{name}r"].bodies()[0]) for name in ("W1", "W2", "W3")}


def service_env(batching: bool, extra: dict[str, str]) -> dict[str, str]:
    """The settings every measured service runs with: one ORT thread on its one core, and its default
    log level (so the access log is written, as in production)."""
    return {"ATTEND_INTRA_OP_THREADS": "1", "ATTEND_BATCHING": str(batching).lower(), "ATTEND_LOG_LEVEL": "info",
            **extra}


PLAIN = (sys.executable, "-m", "uvicorn", "bench.plain_server:app", "--port", "{port}", "--log-level", "warning")


def server(kind: str, repository: Path, extra: dict[str, str], grpc_port: int = 0, device: str = "cpu",
           log_path: Path | None = None):
    """A server to measure, started the same way for each kind: pinned to the server core, a fresh
    process. `kind` is "plain" (bench/plain_server.py), "on" or "off" (the service, batching on/off);
    the service's gRPC server listens on `grpc_port` (0: off). Both run on `device` ("cpu" or "cuda"),
    their stderr into `log_path` (default: a temporary file)."""
    if kind == "plain":
        return running_service(repository, prefix=PIN, command=PLAIN, ready_path="/docs", log_path=log_path,
                               PLAIN_REPOSITORY=str(repository), PLAIN_DEVICE=device)
    return running_service(repository, prefix=PIN, log_path=log_path, **service_env(
        kind == "on", {"ATTEND_GRPC_PORT": str(grpc_port), "ATTEND_DEVICE": device, **extra}))


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process so far (its threads included), or of one of its threads."""
    fields = proc_stat(pid if thread is None else f"{pid}/task/{thread}")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def binary_request(body: dict) -> tuple[bytes, int]:
    """An /attend body as an Open Inference Protocol binary request: (body, JSON header length)."""
    _, content, header_length = v2_binary(body)
    return content, header_length


def wrk(port: int, body_file: Path, connections: int, seconds: float, pid: int | None = None,
        path: str = "/attend", header_length: int | None = None) -> dict:
    cmd = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--timeout", "10s", "-s", str(ROOT / "bench" / "post.lua"), f"http://127.0.0.1:{port}{path}"]
    cpu_before = cpu_seconds(pid) if pid else 0.0
    env = os.environ | {"BODY": str(body_file)} | ({"HEADER_LENGTH": str(header_length)} if header_length else {})
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    result = json.loads(line)
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    if pid:
        result["cpu_us"] = 1e6 * (cpu_seconds(pid) - cpu_before) / max(result["requests"], 1)
    return result


def machine(device: str = "cpu") -> str:
    import onnxruntime

    provider = "CPU execution provider"
    if device == "cuda":
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().replace(", ", ", driver ")
        provider = f"CUDA execution provider on {gpu or 'a GPU nvidia-smi did not name'}"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    wrk_version = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("[")[0].strip()
    return (f"{cpu}, {os.cpu_count()} cores; Linux {platform.release()}; Python {platform.python_version()}, "
            f"onnxruntime {onnxruntime.__version__} ({provider}), numpy {np.__version__}; {wrk_version}")


def point_record(row: str, c: int, server: str, rnd: int, point, cpu_us: float) -> dict:
    timed = point.requests > 0  # else no percentiles (null in the file)
    return {"row": row, "concurrency": c, "server": server, "round": rnd, "requests": point.requests,
            "seconds": round(point.seconds, 3), "rps": round(point.rps, 1),
            "p50_ms": round(point.percentile(50), 3) if timed else None,
            "p99_ms": round(point.percentile(99), 3) if timed else None, "cpu_us": round(cpu_us, 1) if timed else None}


def run(args: argparse.Namespace) -> dict:
    """The measurement: every row at every concurrency, each server alternately, over rounds."""
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    servers = args.servers.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    extra = dict(s.split("=", 1) for s in args.set)
    tmp = Path(tempfile.mkdtemp(prefix="attend-bench-"))
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    print(f"pools of bodies (seed {args.seed}) ...", file=sys.stderr)
    pools = make_pools(tmp, rows, args.seed)
    points = []
    try:
        with contextlib.ExitStack() as stack:
            running = {}
            for name in servers:  # every server up for the whole run, each pinned to the server core
                grpc_port = free_port() if name != "plain" else 0
                url, proc = stack.enter_context(server(SERVERS[name], args.repository, extra, grpc_port, args.device))
                running[name] = ({"wrk": int(url.rsplit(":", 1)[1]), "grpc": grpc_port}, proc)
            for rnd in range(args.rounds):
                for row in rows:
                    transport = TRANSPORTS[ROWS[row][1]]
                    for c in concurrency:
                        order = servers if rnd % 2 == 0 else servers[::-1]
                        for name in order:
                            if name == "plain" and not transport.plain:
                                continue
                            ports, proc = running[name]
                            port = ports[transport.client]
                            print(f"[{rnd + 1}/{args.rounds}] {row} c={c} {name} ...", file=sys.stderr)
                            index = pools[row]["index"]
                            if args.warmup > 0 and rnd == 0:  # the first round warms each server up
                                measure(transport.client, port, index, c, args.warmup)
                            cpu_before = cpu_seconds(proc.pid)
                            point = measure(transport.client, port, index, c, args.duration)
                            cpu_us = 1e6 * (cpu_seconds(proc.pid) - cpu_before) / max(point.requests, 1)
                            if not point.ok:
                                raise RuntimeError(f"{row} c={c} {name}: {point.failed} failed {point.statuses}, "
                                                   f"errors {point.errors}")
                            points.append(point_record(row, c, name, rnd, point, cpu_us))
    finally:
        shutil.rmtree(tmp)
    return {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": round((time.monotonic() - clock) / 60, 1),
        "command": " ".join(["python bench/run.py", *sys.argv[1:]]),
        "machine": machine(args.device),
        "settings": {"device": args.device, "rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                     "concurrency": concurrency, "servers": servers, "seed": args.seed, "server_cpu": SERVER_CPU,
                     "load_cpu": LOAD_CPU, "service_settings": extra},
        "rows": {row: {"workload": ROWS[row][0], "transport": ROWS[row][1], "text": WORKLOADS[ROWS[row][0]].text,
                       "transport_text": TRANSPORTS[ROWS[row][1]].text,
                       "replayed": WORKLOADS[ROWS[row][0]].replayed, "bodies": pools[row]["bodies"],
                       "median_bytes": pools[row]["median_bytes"]} for row in rows},
        "points": points,
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(results: dict) -> list[dict]:
    """For each row and concurrency: medians over rounds for each server, and the service's paired
    per-round ratios to the plain server (the plain server's JSON row of the same workload where the
    plain server does not speak the row's transport)."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for p in results["points"]:
        by_key.setdefault((p["row"], p["concurrency"], p["server"]), {})[p["round"]] = p
    out = []
    for row, info in results["rows"].items():
        plain_row = row if TRANSPORTS[info["transport"]].plain else info["workload"]
        for c in results["settings"]["concurrency"]:
            plain = by_key.get((plain_row, c, "plain"), {})
            entry = {"row": row, "concurrency": c, "plain_row": plain_row, "servers": {}}
            for name in results["settings"]["servers"]:
                runs = by_key.get((row if name != "plain" else plain_row, c, name), {})
                if not runs:
                    continue
                med = {k: _median([r[k] for r in runs.values() if r[k] is not None])
                       for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
                if name != "plain" and plain:
                    paired = [(r, plain[n]) for n, r in sorted(runs.items())  # rounds where both answered
                              if n in plain and r["requests"] and plain[n]["requests"]]
                    if not paired:
                        entry["servers"][name] = med
                        continue
                    med["x_plain"] = _median([r["rps"] / b["rps"] for r, b in paired])
                    med["x_plain_rounds"] = [round(r["rps"] / b["rps"], 2) for r, b in paired]
                    med["p99_x_plain"] = _median([r["p99_ms"] / b["p99_ms"] for r, b in paired])
                entry["servers"][name] = med
            out.append(entry)
    return out


def front_doors(results: dict) -> list[dict]:
    """The service through one front door against another (pools.FRONT_DOORS), for each concurrency: the
    median of the per-round ratios of throughput and of p99, both rows measured in the same round."""
    rounds: dict[tuple, dict] = {}
    for p in results["points"]:
        if p["server"] == "service":
            rounds.setdefault((p["row"], p["concurrency"]), {})[p["round"]] = p
    out = []
    for row, against in FRONT_DOORS.items():
        if row not in results["rows"] or against not in results["rows"]:
            continue
        for c in results["settings"]["concurrency"]:
            mine, theirs = rounds.get((row, c), {}), rounds.get((against, c), {})
            paired = [(mine[n], theirs[n]) for n in sorted(mine) if n in theirs and mine[n]["requests"]
                      and theirs[n]["requests"]]
            if paired:
                out.append({"row": row, "against": against, "concurrency": c,
                            "x": _median([a["rps"] / b["rps"] for a, b in paired]),
                            "rounds": [round(a["rps"] / b["rps"], 2) for a, b in paired],
                            "p99_x": _median([a["p99_ms"] / b["p99_ms"] for a, b in paired])})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def render(results: dict) -> tuple[list[str], list[str]]:
    """(docs/benchmarks.md's section, README's short table) from a results file."""
    summary = summarise(results)
    settings = results["settings"]
    servers = [s for s in settings["servers"] if s != "plain"]
    head = ["| row | bodies | c | plain req/s | " + " | ".join(f"{s} req/s | x plain | per round" for s in servers)
            + " | plain p50 ms | " + " | ".join(f"{s} p50 ms" for s in servers) + " | plain p99 ms | "
            + " | ".join(f"{s} p99 ms | p99 x plain" for s in servers) + " | plain CPU us / req | "
            + " | ".join(f"{s} CPU us / req" for s in servers) + " |"]
    cols = head[0].count("|") - 1
    head.append("| --- | --- |" + " ---: |" * (cols - 2))
    lines = list(head)
    for e in summary:
        info = results["rows"][e["row"]]
        plain = e["servers"].get("plain", {})
        cells = [e["row"], "replayed" if info["replayed"] else f"{info['bodies']} varied", str(e["concurrency"]),
                 _fmt(plain.get("rps"), ".0f") + ("" if e["plain_row"] == e["row"] else f" ({e['plain_row']})")]
        for s in servers:
            m = e["servers"].get(s, {})
            cells += [_fmt(m.get("rps"), ".0f"), _fmt(m.get("x_plain"), ".2f") + "x" if "x_plain" in m else "-",
                      " ".join(f"{x:.2f}" for x in m.get("x_plain_rounds", [])) or "-"]
        cells.append(_fmt(plain.get("p50_ms"), ".2f"))
        cells += [_fmt(e["servers"].get(s, {}).get("p50_ms"), ".2f") for s in servers]
        cells.append(_fmt(plain.get("p99_ms"), ".2f"))
        for s in servers:
            m = e["servers"].get(s, {})
            cells += [_fmt(m.get("p99_ms"), ".2f"),
                      _fmt(m.get("p99_x_plain"), ".2f") + "x" if "p99_x_plain" in m else "-"]
        cells.append(_fmt(plain.get("cpu_us"), ".0f"))
        cells += [_fmt(e["servers"].get(s, {}).get("cpu_us"), ".0f") for s in servers]
        lines.append("| " + " | ".join(cells) + " |")

    concurrency = settings["concurrency"]
    ratios = ["| row | " + " | ".join(f"x plain c={c}" for c in concurrency) + " | "
              + " | ".join(f"p99 x plain c={c}" for c in concurrency) + " |",
              "| --- |" + " ---: |" * (2 * len(concurrency))]
    for row, info in results["rows"].items():
        found = {e["concurrency"]: e["servers"].get("service", {}) for e in summary if e["row"] == row}
        label = f"{row}: {info['text']}" + ("" if info["transport"] == "json" else f"; {info['transport_text']}")
        ratios.append(f"| {label} | " + " | ".join(
            f"{found[c]['x_plain']:.2f}x" if "x_plain" in found.get(c, {}) else "-" for c in concurrency) + " | "
            + " | ".join(f"{found[c]['p99_x_plain']:.2f}x" if "p99_x_plain" in found.get(c, {}) else "-"
                         for c in concurrency) + " |")

    legend = [f"- {row}: {info['text']}" + ("" if info["replayed"] else f"; a pool of {info['bodies']} bodies, "
                                                                          f"median {info['median_bytes']} bytes")
              + ("" if info["transport"] == "json" else f"; sent as {info['transport_text']}")
              for row, info in results["rows"].items()]
    method = (f"Each server pinned to core {settings['server_cpu']} with one ONNX Runtime thread, both up for the "
              f"whole run; the load generator (wrk with bench/pool.lua, one thread a connection; for gRPC rows "
              f"bench/grpc_load.py, one process a connection) on core "
              f"{settings['load_cpu']}, a different body of the row's pool a request, each request timed. "
              f"{settings['rounds']} rounds, the servers alternating point by point (the order swapped every "
              f"other round); {settings['duration_s']:g} s a point, after {settings['warmup_s']:g} s of warm-up in the "
              "first round. "
              "Figures are medians over the rounds; x plain is the median of the per-round ratios of the "
              "service's figure to the plain server's measured beside it (listed under per round); "
              "p99 x plain below 1 is a shorter tail than the plain server's. CPU us / req: the server "
              "process's user + system time over the point, a request. The run took "
              f"{results['minutes']:g} min."
              + (" Both servers on ONNX Runtime's CUDA execution provider (model.onnx, TF32 off)."
                 if settings.get("device") == "cuda" else ""))
    doors = front_doors(results)
    door_lines = ["| row | against | c | req/s x | per round | p99 x |", "| --- | --- | ---: | ---: | --- | ---: |"]
    door_lines += [f"| {d['row']} | {d['against']} | {d['concurrency']} | {d['x']:.2f}x | "
                   + " ".join(f"{x:.2f}" for x in d["rounds"]) + f" | {d['p99_x']:.2f}x |" for d in doors]
    doors_part = ["The service through gRPC against HTTP, in this run (throughput and p99 of the first row as "
                  "multiples of the second's; per round paired):", "", *door_lines, ""] if doors else []
    section = [method, "", *legend, "",
               "- plain: bench/plain_server.py, the ~50-line FastAPI server a user could write instead (orjson, "
               "NumPy, the same ONNX models, no checks, no batching); a row the plain server does not speak "
               "compares with its JSON row (named in brackets)",
               "- service: `python -m service` at its defaults (access log on)"
               + ("; service-nobatch: the same with `ATTEND_BATCHING=false`" if "service-nobatch" in servers else ""),
               "", "The service's throughput and p99 as multiples of the plain server's:", "", *ratios, "",
               *doors_part,
               "Every server, medians over the rounds:", "", *lines]
    readme = ["The service's throughput and p99 latency as multiples of the plain server's (medians over "
              f"{settings['rounds']} rounds; every server's figures: `python bench/run.py --report` of the run's "
              "results file):", "", *ratios,
              *([""] + doors_part[:-1] if doors else [])]
    return section, readme


HEADLINE_ROW = "W1"


def headline(results: dict) -> list[str]:
    """The README's one figure: the service's requests/s on HEADLINE_ROW at the run's highest concurrency,
    and what it is compared with, the plain server measured beside it."""
    c = max(results["settings"]["concurrency"])
    entry = next((e for e in summarise(results) if e["row"] == HEADLINE_ROW and e["concurrency"] == c), None)
    servers = entry["servers"] if entry else {}
    if "x_plain" not in servers.get("service", {}):
        raise SystemExit(f"--headline needs row {HEADLINE_ROW} at c={c} from both the plain server and the service")
    service, plain = servers["service"], servers["plain"]
    return [f"**{service['rps']:.0f} requests/s** from the service on one core, against **{plain['rps']:.0f}** from "
            "the plain FastAPI + ONNX Runtime server a user could write instead (`bench/plain_server.py`: the same "
            f"models, no checks, no batching). Paired round by round, the service is {service['x_plain']:.2f}x as "
            f"fast. p99 latency: {service['p99_ms']:.1f} ms against {plain['p99_ms']:.1f} ms. The load: "
            f"{HEADLINE_ROW}, {results['rows'][HEADLINE_ROW]['text']}, {c} connections, a different body each "
            f"request. Medians of {results['settings']['rounds']} rounds."]


def report(results: dict, out: Path | None, readme: Path | None, name: str = "bench",
           headline_to: Path | None = None) -> None:
    section, short = render(results)
    where = results["machine"]
    if out:
        write_section(out, name, section, stamp=results["date"], command=results["command"], where=where)
    if readme:
        write_section(readme, f"{name}-ratios", short, stamp=results["date"], command=results["command"], where=where)
    if headline_to:
        write_section(headline_to, f"{name}-headline", headline(results), stamp=results["date"],
                      command=results["command"], where=where)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rows", "--workloads", default=",".join(DEFAULT_ROWS),
                        help=f"rows to measure (default: all): {', '.join(f'{k}' for k in ROWS)}")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", "--repeat", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds a point (whole seconds)")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds of load before each point of the first round (0: none)")
    parser.add_argument("--servers", default="plain,service",
                        help="plain, service, service-nobatch (the service with ATTEND_BATCHING=false)")
    parser.add_argument("--seed", type=int, default=SEED, help="the pools' seed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the execution provider both servers run on (cuda: a GPU and onnxruntime-gpu)")
    parser.add_argument("--section", default="bench",
                        help="the sections written: <!-- NAME --> in --out, <!-- NAME-ratios --> in --readme")
    parser.add_argument("--set", action="append", default=[], metavar="ATTEND_X=V",
                        help="a service setting for every run (repeatable)")
    parser.add_argument("--results", type=Path, help="write the results (JSON) here")
    parser.add_argument("--report", type=Path, metavar="RESULTS",
                        help="measure nothing: write the report of this results file into --out and --readme")
    parser.add_argument("--out", type=Path, help="a markdown file with a <!-- bench --> section (docs/benchmarks.md)")
    parser.add_argument("--readme", type=Path, help="a markdown file with a <!-- bench-ratios --> section")
    parser.add_argument("--headline", type=Path,
                        help="a markdown file with a <!-- bench-headline --> section (README.md)")
    args = parser.parse_args()
    if args.report:
        results = json.loads(args.report.read_text())
    else:
        if shutil.which("wrk") is None:
            print("wrk is needed: apt-get install wrk", file=sys.stderr)
            return 2
        if (os.cpu_count() or 1) < 2:
            print("warning: one core; server and load generator share it", file=sys.stderr)
        results = run(args)
        if args.results:
            args.results.write_text(json.dumps(results, indent=1) + "\n")
    section, _ = render(results)
    print("\n".join(section))
    report(results, args.out, args.readme, args.section, args.headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
