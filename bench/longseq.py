"""Long sequences, outputs only (issue 40): requests that ask for no weights, batch 1, n_q = n_k = n, for
dot_product (d = 64) and multi_head (8 heads of 64: num_hiddens 512), each run by model.onnx (the traced
graph: it writes the (heads, n, n) scores at each of its steps), by the graph the service runs for a
batch without weights (model.cuda.outputs.onnx on CUDA: one `Attention` node on ONNX Runtime's fused
kernels; model.cpu.outputs.onnx on the CPU), and by CUDA's graph with its `Attention` in fp16
(model.cuda.outputs.fp16.onnx, which Flash attention takes; not served: this bench says whether it would
pay). For each: the median time of a run (session.run with NumPy inputs and the outputs fetched, as the
service calls it), the memory it holds, the kernel the `Attention` node ran (from ONNX Runtime's VERBOSE
log), the largest difference between its outputs and model.onnx's, and the longest n each serves in one
request.

Each point runs in a process of its own (`--point`), so that its memory is its own and a failure (out of
memory, a crash, a time-out) is a row of the table, never the end of the bench; a graph that fails at
some n is not tried at larger ones. The kernel: ONNX Runtime logs its choice at VERBOSE through its
default logger, which a session made meanwhile follows, logging at every run; so a first session runs
once at VERBOSE and is let go, and a second, quiet, is measured. Memory, CUDA: the device's used memory
(cudaMemGetInfo, else nvidia-smi) after that session is made and after its runs, less before it (the
CUDA context made first, not counted); the CUDA execution provider's arena grows by what is asked
(arena_extend_strategy kSameAsRequested) and gives nothing back, so after the runs it holds its
high-water mark. CPU: the process's resident memory (VmRSS before, its peak VmHWM after: ru_maxrss would
keep the parent's size at the fork across exec). CUDA runs
with use_tf32=0, as the service by default; one intra-op thread.

Bounded: each point by --point-timeout, the whole table by --budget (points left over are rows "not run");
timed runs as many as fit in --seconds (at least 3, at most --repeats), so fewer at large n. Timings need
the machine to themselves.

    python bench/longseq.py --export DIR      # the two models (export's builders) and their fp16 graphs
    python bench/longseq.py --device cuda --repository DIR --results docs/benchmarks-longseq-cuda.json \\
                            --out docs/benchmarks.md
    python bench/longseq.py --device cpu --sizes 128 256        # on a machine without a GPU
    python bench/longseq.py --report --results FILE [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The models: export's builders with these hyperparameters (dot_product's d is the request's).
D = 64
HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "dot_product": {},
    "multi_head": {"key_size": 512, "query_size": 512, "value_size": 512, "num_hiddens": 512, "num_heads": 8,
                   "bias": False},
}
SIZES = {"cuda": [512, 1024, 2048, 4096, 8192, 16384, 32768], "cpu": [256, 512, 1024, 2048]}
DECOMPOSED = "model.onnx"
HALF = "model.cuda.outputs.fp16.onnx"  # export.fused's fp16 form, written by `export` beside the version's files

# What ONNX Runtime's CUDA kernel of `Attention` logs at VERBOSE when it picks a kernel
# (onnxruntime/core/providers/cuda/llm/attention.cc, ComputeInternal, through LOGS_DEFAULT: the default
# logger, `onnxruntime.set_default_logger_severity(0)`, not the session's), as 1.31.1's library holds them.
_KERNEL_LINE = re.compile(r"ONNX Attention: using (cuDNN SDPA|Flash Attention|Memory Efficient Attention)"
                          r"|Attention: using (unified unfused path)")
KERNELS = {"cuDNN SDPA": "cuDNN SDPA", "Flash Attention": "Flash", "Memory Efficient Attention": "MEA",
           "unified unfused path": "unfused"}
_OOM = re.compile(r"out of memory|Failed to allocate|ALLOC_FAILED|cudaErrorMemoryAllocation", re.I)


def kernels_in(log: str) -> list[str]:
    """The kernels ONNX Runtime's VERBOSE log says the CUDA `Attention` nodes ran, in order, each once:
    "Flash", "MEA" (memory-efficient), "cuDNN SDPA", "unfused"."""
    found = [KERNELS[m.group(1) or m.group(2)] for m in _KERNEL_LINE.finditer(log)]
    return list(dict.fromkeys(found))


def outputs_graph(device: str) -> str:
    """The file the service runs for a batch without weights on `device`."""
    from export.repository import CPU_OUTPUTS_MODEL_FILE, CUDA_OUTPUTS_MODEL_FILE

    return CUDA_OUTPUTS_MODEL_FILE if device == "cuda" else CPU_OUTPUTS_MODEL_FILE


def export(folder: Path) -> Path:
    """The bench's models in `folder`, as `python -m export` writes a model (validated, every graph), and
    beside each version's files its fp16 graph (`HALF`), validated to export.fused.HALF_TOLERANCE."""
    import torch

    from export.build import build_module
    from export.fused import HALF_TOLERANCE, export_fused
    from export.publish import export_model
    from export.validate import validate

    for kind, hp in HYPERPARAMETERS.items():
        config = export_model(folder, kind, kind, dict(hp))
        torch.manual_seed(0)  # export_model's default seed: the same weights
        module = build_module(kind, dict(hp))
        half = folder / kind / str(config.version) / HALF
        export_fused(module, kind, hp, half, weights=False, cuda=True, half=True)
        validate(module, kind, hp, half, weights=False, tolerance=HALF_TOLERANCE)
        print(f"exported {kind} version {config.version} ({hp or f'd = {D} from the request'}) into {folder}")
    return folder


def feed(kind: str, n: int, lengths: str) -> dict[str, Any]:
    """The request's inputs, the same for both graphs at one n (seeded by n): valid lengths one an example
    (every key: absent lengths, as the service feeds them) or one a query (random, 1 to n)."""
    import numpy as np

    rng = np.random.default_rng(n)
    f = HYPERPARAMETERS[kind].get("num_hiddens", D)
    inputs = {name: rng.standard_normal((1, n, f), dtype=np.float32) for name in ("queries", "keys", "values")}
    inputs["valid_lens"] = (np.full((1, n), n, dtype=np.int64) if lengths == "example"
                            else rng.integers(1, n + 1, size=(1, n), dtype=np.int64))
    return inputs


class Memory:
    """Memory in use, MiB: the GPU's (cudaMemGetInfo through the CUDA runtime ONNX Runtime loads, else
    nvidia-smi), or this process's resident memory."""

    def __init__(self, device: str):
        self.device, self.source, self._cudart = device, "VmRSS / VmHWM", None
        if device != "cuda":
            return
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            with contextlib.suppress(OSError):
                self._cudart = ctypes.CDLL(name)
                self.source = "cudaMemGetInfo"
                return
        self.source = "nvidia-smi" if shutil.which("nvidia-smi") else "none"

    def used(self, peak: bool = False) -> float | None:
        if self.device != "cuda":
            status = Path("/proc/self/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+)" if peak else r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        if self._cudart is not None:
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            if self._cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
                return (total.value - free.value) / 2**20
        if self.source == "nvidia-smi":
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                  os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                 capture_output=True, text=True, timeout=20).stdout
            return float(out.split()[0]) if out.strip() else None
        return None


def point(spec: dict[str, Any]) -> dict[str, Any]:
    """One point, in this process: on CUDA, for the fused graph, a session that runs once at VERBOSE (the
    kernel's line on stderr, which the parent reads) and is let go; then the measured session, an untimed
    run and the timed ones; the outputs saved for the parent to compare. Any failure is the result's
    status, never an exception."""
    device = spec["device"]
    if device == "cuda" and importlib.util.find_spec("nvidia") is not None:
        import onnxruntime

        with contextlib.suppress(Exception):  # CUDA and cuDNN from the pip wheels, where they are
            onnxruntime.preload_dlls()
    import numpy as np
    import onnxruntime as ort

    result: dict[str, Any] = {"status": "ok"}
    memory = Memory(device)
    result["memory_source"] = memory.source
    wanted = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    providers: list[Any] = [wanted]
    if device == "cuda":
        providers = [(wanted, {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"})]

    def session(severity: int) -> Any:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = severity
        made = ort.InferenceSession(spec["path"], options, providers=providers)
        if made.get_providers()[0] != wanted:  # ONNX Runtime falls back to the CPU silently
            raise RuntimeError(f"the session runs on {made.get_providers()[0]}, not {wanted}")
        return made

    try:
        inputs = feed(spec["kind"], spec["n"], spec["lengths"])
        if device == "cuda" and spec.get("probe"):
            # One run at VERBOSE, the kernel's choice on stderr for the parent: the kernel logs through the default
            # logger, and a session made meanwhile takes its severity. That session is let go: at VERBOSE it
            # would log at every run (and warn that onnx's shape inference sized an axis 0), which the timed
            # session does not.
            ort.set_default_logger_severity(0)
            session(0).run(["outputs"], inputs)
            ort.set_default_logger_severity(3)
        before = memory.used()
        timed = session(3)
        after_session = memory.used()
        (outputs,) = timed.run(["outputs"], inputs)  # untimed
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < spec["repeats"] and (len(times) < 3 or time.perf_counter() - started < spec["seconds"]):
            start = time.perf_counter()
            timed.run(["outputs"], inputs)
            times.append((time.perf_counter() - start) * 1e3)
        after_runs = memory.used(peak=True)
        if spec.get("save"):
            np.save(spec["save"], outputs)
        result |= {"ms": statistics.median(times), "runs": len(times), "finite": bool(np.isfinite(outputs).all())}
        if None not in (before, after_session, after_runs):
            result |= {"session_mib": after_session - before, "run_mib": after_runs - after_session}
    except Exception as e:  # out of memory, or any other refusal: the row says which
        text = str(e).strip()
        line = next((x for x in text.splitlines() if _OOM.search(x)), text.splitlines()[0] if text else repr(e))
        result["status"] = "OOM" if _OOM.search(text) else "failed"
        result["error"] = line[:300]
    return result


def machine(device: str) -> str:
    """The GPU (name, driver, memory) where one is used, the CPU and its cores."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    where = f"{cpu}, {os.cpu_count()} cores"
    if device != "cuda":
        return where + ", no GPU used"
    gpu = "GPU unknown (no nvidia-smi)"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        if out:
            name, driver, total = (x.strip() for x in out[0].split(","))
            gpu = f"{name} (driver {driver}, {total})"
    return f"{gpu}; {where}"


def _run_point(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`spec` in a process of its own, at most `timeout` seconds; its kernels from its log."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--point", json.dumps(spec), "--point-out", out.name]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"over {timeout:.0f} s", "seconds": time.perf_counter() - started}
        text = Path(out.name).read_text()
        if done.returncode != 0 or not text:
            tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
            return {"status": "crashed", "error": f"exit {done.returncode}: {tail}",
                    "seconds": time.perf_counter() - started}
        result = json.loads(text)
    result["kernels"] = kernels_in(done.stderr)
    result["seconds"] = time.perf_counter() - started
    return result


def sweep(args: argparse.Namespace, repository: Path) -> dict[str, Any]:
    """Every point, n by n (each graph of each kind at one n before the next n), within the budget."""
    import numpy as np
    import onnxruntime as ort

    from export.repository import read_config

    started = time.perf_counter()
    graphs = [DECOMPOSED, outputs_graph(args.device), HALF]
    points: list[dict[str, Any]] = []
    failed: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory(prefix="longseq.") as tmp:
        for n in args.sizes:
            for kind in args.kinds:
                config = read_config(repository / kind)
                files = {DECOMPOSED: config.model_file}
                without = config.graph_without_weights(cpu=args.device == "cpu")
                if without is not None:
                    files[graphs[1]] = without[0]
                if (repository / kind / str(config.version) / HALF).is_file():
                    files[HALF] = f"{config.version}/{HALF}"
                saved: dict[str, Path] = {}
                for graph in graphs:
                    row: dict[str, Any] = {"kind": kind, "n": n, "graph": graph}
                    left = args.budget - (time.perf_counter() - started)
                    if graph not in files:
                        row |= {"status": "not run", "error": f"{kind} version {config.version} has no {graph}"}
                    elif (kind, graph) in failed:
                        row |= {"status": "not run", "error": f"failed at n = {failed[(kind, graph)]}"}
                    elif left < 5:
                        row |= {"status": "not run", "error": "the budget was spent"}
                    else:
                        save = Path(tmp) / f"{kind}-{n}-{len(saved)}.npy"
                        spec = {"device": args.device, "path": str(repository / kind / files[graph]), "kind": kind,
                                "n": n, "lengths": args.lengths, "repeats": args.repeats, "seconds": args.seconds,
                                "save": str(save), "probe": graph != DECOMPOSED}
                        row |= _run_point(spec, min(args.point_timeout, left))
                        if row["status"] == "ok":
                            saved[graph] = save
                        else:
                            failed[(kind, graph)] = n
                    points.append(row)
                    print(f"{kind} n={n} {graph}: {row['status']} "
                          + (f"{row['ms']:.4g} ms, {row.get('run_mib', 0):,.0f} MiB, {row['kernels']}"
                             if row["status"] == "ok" else row.get("error", "")), flush=True)
                if DECOMPOSED in saved:  # each fused graph's outputs against model.onnx's
                    reference = np.load(saved[DECOMPOSED]).astype(np.float64)
                    for row in points[-len(graphs):]:
                        if row["graph"] != DECOMPOSED and row["graph"] in saved:
                            row["max_diff"] = float(np.abs(np.load(saved[row["graph"]]) - reference).max())
                for path in saved.values():
                    path.unlink(missing_ok=True)
    return {
        "device": args.device, "machine": machine(args.device),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "bench/longseq.py", *sys.argv[1:]]),
        "onnxruntime": ort.__version__, "lengths": args.lengths, "sizes": args.sizes, "kinds": args.kinds,
        "graphs": graphs, "budget": args.budget, "point_timeout": args.point_timeout,
        "seconds": time.perf_counter() - started, "points": points,
    }


def _cell_ms(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"{row['ms']:.4g}"
    if row["status"] in ("OOM", "timeout"):
        return row["status"]
    return f"{row['status']} ({row.get('error', '')})".replace("|", "/")  # a cell of the table


def _cell_mib(row: dict[str, Any]) -> str:
    if row["status"] != "ok" or "run_mib" not in row:
        return "-"
    return f"{row['session_mib']:,.0f} + {row['run_mib']:,.0f}"


def _longest(points: list[dict[str, Any]], kind: str, graph: str, sizes: list[int]) -> str:
    rows = {r["n"]: r for r in points if r["kind"] == kind and r["graph"] == graph}
    served = [n for n in sizes if rows.get(n, {}).get("status") == "ok"]
    if not served:
        return "none of the sizes tried"
    first_failure = next((rows[n] for n in sizes if n in rows and rows[n]["status"] != "ok"), None)
    if first_failure is None:
        return f"{max(served)} (the largest tried)"
    return f"{max(served)} (n = {first_failure['n']}: {first_failure['status']})"


def table(results: dict[str, Any]) -> list[str]:
    """The markdown table of `results`, a row per model, n and graph, and the longest n each graph serves."""
    device, points, graphs = results["device"], results["points"], results["graphs"]
    memory = "GPU MiB (session + runs)" if device == "cuda" else "resident MiB (session + runs' peak)"
    lines = [
        f"| model | n | graph | ms | {memory} | kernel | time {DECOMPOSED} / this | max diff from {DECOMPOSED} |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    by = {(r["kind"], r["n"], r["graph"]): r for r in points}
    for kind in results["kinds"]:
        hp = HYPERPARAMETERS[kind]
        shape = f"d = {D}" if kind == "dot_product" else \
            f"{hp['num_heads']} heads of {hp['num_hiddens'] // hp['num_heads']}"
        for n in results["sizes"]:
            base = by.get((kind, n, DECOMPOSED))
            for graph in graphs:
                row = by.get((kind, n, graph))
                if row is None or base is None:
                    continue
                ok = row["status"] == "ok"
                ratio = f"{base['ms'] / row['ms']:.2f}" if ok and base["status"] == "ok" and row is not base else "-"
                kernel = "-" if not ok or graph == DECOMPOSED else \
                    ", ".join(row.get("kernels") or []) or ("CPU kernel" if device == "cpu" else "not logged")
                diff = f"{row['max_diff']:.1e}" if "max_diff" in row else "-"
                lines.append(f"| {kind} ({shape}) | {n} | {graph} | {_cell_ms(row)} | {_cell_mib(row)} | {kernel} "
                             f"| {ratio} | {diff} |")
    lines.append("")
    for kind in results["kinds"]:
        served = "; ".join(f"{graph} {_longest(points, kind, graph, results['sizes'])}" for graph in graphs)
        lines.append(f"- {kind}, the longest n served in one request: {served}")
    where = "the device's used memory" if device == "cuda" else "the process's resident memory"
    lengths = "one an example (every key)" if results["lengths"] == "example" else "one a query (random)"
    lines += [
        "",
        f"Batch 1, n_q = n_k = n, valid lengths {lengths}, "
        f"outputs only; each point in a process of its own, the median of its timed runs (session.run, NumPy in "
        f"and out, after an untimed one), ONNX Runtime {results['onnxruntime']}"
        + (", CUDA execution provider with use_tf32=0 and arena_extend_strategy kSameAsRequested" if device == "cuda"
           else ", CPU execution provider")
        + f", one intra-op thread. Memory: {where} "
        f"after the session was made and after the runs, less before it. Kernel: what the `Attention` node "
        f"ran, from ONNX Runtime's VERBOSE log ({DECOMPOSED} has no such node: its MatMuls, Where and Softmax). "
        f"Max diff: the largest difference between the graph's outputs and {DECOMPOSED}'s. A point that fails is "
        f"not tried at larger n; {results['seconds']:.0f} s in all (budget {results['budget']:.0f} s, at most "
        f"{results['point_timeout']:.0f} s a point).",
    ]
    return lines


def report(results: dict[str, Any], out: Path | None, section: str | None = None) -> None:
    lines = table(results)
    print("\n".join(lines))
    if out is not None:
        from tests.load.report import write_section

        write_section(out, section or f"longseq-{results['device']}", lines, stamp=results["date"],
                      command=results["command"], where=results["machine"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repository", type=Path, help="the models, exported by --export (default: export afresh)")
    parser.add_argument("--export", type=Path, metavar="DIR", help="only export the bench's models into DIR")
    parser.add_argument("--sizes", nargs="+", type=int, help="the values of n (default: 512 to 32768 on CUDA, "
                        "256 to 2048 on the CPU)")
    parser.add_argument("--kinds", nargs="+", default=list(HYPERPARAMETERS), choices=list(HYPERPARAMETERS))
    parser.add_argument("--lengths", choices=["example", "query"], default="example",
                        help="valid lengths one an example (nonpad_kv_seqlen) or one a query (the mask)")
    parser.add_argument("--repeats", type=int, default=20, help="most timed runs a point (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=0.5, help="timed runs a point while under this, at "
                        "least 3 (default: %(default)s)")
    parser.add_argument("--point-timeout", type=float, default=30, help="seconds a point (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=150, help="seconds for every point together; the "
                        "points left are rows 'not run' (default: %(default)s)")
    parser.add_argument("--results", type=Path, help="write the results (JSON) here")
    parser.add_argument("--report", action="store_true", help="print (and --out) the table of --results")
    parser.add_argument("--out", type=Path, help="markdown file to write the table into (section "
                        "longseq-<device>)")
    parser.add_argument("--section", help="the section of --out to write (default: longseq-<device>)")
    parser.add_argument("--point", help=argparse.SUPPRESS)
    parser.add_argument("--point-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        args.point_out.write_text(json.dumps(point(json.loads(args.point))))
        return 0
    if args.export:
        export(args.export)
        return 0
    if args.report:
        if args.results is None:
            parser.error("--report needs --results")
        report(json.loads(args.results.read_text()), args.out, args.section)
        return 0
    args.sizes = args.sizes or SIZES[args.device]
    missing = [kind for kind in args.kinds
               if args.repository and not (args.repository / kind / "config.json").is_file()]
    if missing:
        parser.error(f"{args.repository} has no {', '.join(missing)}: "
                     "`python bench/longseq.py --export DIR` writes them")
    with tempfile.TemporaryDirectory(prefix="longseq-repo.") as tmp:
        repository = args.repository or export(Path(tmp) / "repo")
        results = sweep(args, repository)
    if args.results:
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    print()
    report(results, args.out, args.section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
