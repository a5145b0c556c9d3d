"""What one worker process holds (issue 40): the repository loaded as `python -m service` loads it (every
model's sessions, checked, their graphs timed and warmed up: service.core.dataplane.load_registry), then
each model served from the inference threads. A CUDA worker held 2.1-2.4 GiB of GPU memory on an H200,
the plain server's 1 GiB; this says where it goes, and what each candidate change would save.

Each configuration runs in a process of its own, changing only what it names:

  served             the service as it is
  one-thread         the runs on the thread that loaded, not on --threads others: on CUDA each thread a
                     session runs on gets that session's own cuBLAS, cuBLASLt and cuDNN handles
  same-as-requested  CUDA's arenas extended by what a run asks (arena_extend_strategy 1), not by doubling
  shared-arena       one CUDA arena for every session of the process (an environment allocator, which the
                     sessions use already for the CPU's: service.core.sessions)
  shrink             after the runs, each CUDA session gives its arena's free regions back
                     (memory.enable_memory_arena_shrinkage gpu:0), as the CPU's do after warm-up
  no-cuda-outputs    no CUDA session of the graphs without weights (model.cuda.outputs.onnx): one CUDA session
                     a model fewer, to tell what one costs
  small-cublas       cuBLAS's default workspace, which each handle allocates (a handle for each session and
                     each thread it runs on), cut to one 4 MiB chunk (CUBLAS_WORKSPACE_CONFIG=:4096:1)

Memory, MiB: resident (VmRSS) always; on CUDA the GPU's used memory (cudaMemGetInfo) less what it was
before the process started, so a worker's CUDA context counts. Read after the load (warm-up included) and
after the runs. The CUDA-only configurations are not run on the CPU.

    python bench/worker_memory.py [--device cuda|cpu] [--repository DIR] [--results FILE] [--out docs/benchmarks.md]
    python bench/worker_memory.py --report --results FILE [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.longseq import Memory, machine  # noqa: E402
from bench.scaling import gpu_used_mib  # noqa: E402

CONFIGS = ["served", "one-thread", "same-as-requested", "shared-arena", "shrink", "no-cuda-outputs", "small-cublas"]
CUDA_ONLY = {"same-as-requested", "shared-arena", "shrink", "no-cuda-outputs", "small-cublas"}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this process: load, serve, measure. A failure is the result's status."""
    from service.core import sessions

    device, config = spec["device"], spec["config"]
    if config == "small-cublas":  # read by cuBLAS when it makes a handle
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:1"
    if device == "cuda":
        sessions.preload_cuda()
    import numpy as np
    import onnxruntime as ort

    from export.repository import example_feed
    from service.config import Settings
    from service.core.choice import _WARM_SIZES
    from service.core.dataplane import load_registry

    resident, cuda = Memory("cpu"), Memory("cuda") if device == "cuda" else None

    def measure() -> dict[str, float | None]:
        return {"resident_mib": resident.used(), "gpu_used_mib": cuda.used() if cuda else None}

    if config == "same-as-requested":
        plain = sessions.providers_for

        def providers_for(device: str, cuda_tf32: bool) -> list[Any]:
            return [(p[0], {**p[1], "arena_extend_strategy": "kSameAsRequested"}) if isinstance(p, tuple) else p
                    for p in plain(device, cuda_tf32)]

        sessions.providers_for = providers_for
        import service.core.runtime as runtime

        runtime.providers_for = providers_for
    if config == "no-cuda-outputs":
        from export.repository import ModelConfig

        with_outputs = ModelConfig.graph_without_weights

        def cpu_only(self: ModelConfig, cpu: bool = True) -> tuple[str, str, int] | None:
            return with_outputs(self, cpu) if cpu else None

        ModelConfig.graph_without_weights = cpu_only  # type: ignore[method-assign]
    if config == "shared-arena":  # the sessions' options ask for the environment's allocators already
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator_v2(sessions.CUDA, info, {"device_id": "0"},
                                             ort.OrtArenaCfg({"arena_extend_strategy": 1}))
    result: dict[str, Any] = {"status": "ok", "start": measure()}
    settings = Settings(model_repository=Path(spec["repository"]), device=device, workers=1)
    started = time.perf_counter()
    registry = load_registry(settings)
    result["load_s"] = time.perf_counter() - started
    result["loaded"] = measure()
    models = [m for name in registry.names() if (m := registry.get(name)) is not None]
    graphs = [g for m in models for g in m.graphs]
    result["sessions"] = {"cuda": sum(g.provider == sessions.CUDA for g in graphs),
                          "cpu": sum(g.provider == sessions.CPU for g in graphs), "models": len(models)}
    rng = np.random.default_rng(0)
    feeds = [(m, [example_feed(m.kind, m.config.hyperparameters, sizes, rng) for sizes in _WARM_SIZES])
             for m in models]

    def serve(_: int = 0) -> None:
        for _ in range(spec["runs"]):
            for model, sized in feeds:
                for feed in sized:
                    model.run(feed)
                    model.run(feed, weights=False)

    threads = 1 if config == "one-thread" else spec["threads"]
    if config == "one-thread":
        serve()
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="inference") as pool:
            list(pool.map(serve, range(threads)))
    result["threads"] = threads
    result["served"] = measure()
    if config == "shrink":
        shrink = ort.RunOptions()
        shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "gpu:0")
        for model, sized in feeds:
            for graph in model.graphs:
                if graph.provider == sessions.CUDA:
                    graph.session.run(None, sized[0], shrink)
        result["served"] = measure()
    return result


def _run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`spec` in a process of its own, at most `timeout` seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
                   "--worker-out", out.name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"over {timeout:.0f} s"}
        text = Path(out.name).read_text()
        if done.returncode != 0 or not text:
            tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
            return {"status": "crashed", "error": f"exit {done.returncode}: {tail}"}
        return json.loads(text)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    started, rows = time.perf_counter(), []
    for config in args.configs:
        row: dict[str, Any] = {"config": config}
        left = args.budget - (time.perf_counter() - started)
        if config in CUDA_ONLY and args.device != "cuda":
            continue
        if left < 10:
            row |= {"status": "not run", "error": "the budget was spent"}
        else:
            before = gpu_used_mib() if args.device == "cuda" else None
            spec = {"device": args.device, "config": config, "repository": str(args.repository.resolve()),
                    "threads": args.threads, "runs": args.runs}
            row |= _run(spec, min(args.timeout, left)) | {"gpu_before_mib": before}
        rows.append(row)
        print(f"{config}: {row['status']} {row.get('error', '')}", flush=True)
    return {"device": args.device, "machine": machine(args.device),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python", "bench/worker_memory.py", *sys.argv[1:]]),
            "onnxruntime": ort.__version__, "threads": args.threads, "runs": args.runs, "rows": rows,
            "seconds": time.perf_counter() - started}


def _mib(row: dict[str, Any], stage: str, what: str) -> float | None:
    value = row.get(stage, {}).get(what)
    if value is None or what == "resident_mib":
        return value
    before = row.get("gpu_before_mib")
    return None if before is None else value - before


def table(results: dict[str, Any]) -> list[str]:
    cuda = results["device"] == "cuda"
    head = ["configuration", "sessions (CUDA + CPU)", "threads that ran", "resident MiB loaded", "resident MiB served"]
    if cuda:
        head += ["GPU MiB at start", "GPU MiB loaded", "GPU MiB served", "x served"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | ---: |" + " ---: |" * (len(head) - 3)]
    base = next((r for r in results["rows"] if r["config"] == "served" and r["status"] == "ok"), None)
    for row in results["rows"]:
        if row["status"] != "ok":
            error = " ".join(row.get("error", "").replace("|", "/").split())  # one cell
            lines.append(f"| {row['config']} | {row['status']}: {error} |" + " |" * (len(head) - 2))
            continue
        s = row["sessions"]
        cells = [row["config"], f"{s['cuda']} + {s['cpu']} ({s['models']} models)", str(row["threads"]),
                 f"{row['loaded']['resident_mib']:,.0f}", f"{row['served']['resident_mib']:,.0f}"]
        if cuda:
            gpu = [_mib(row, stage, "gpu_used_mib") for stage in ("start", "loaded", "served")]
            cells += [f"{v:,.0f}" if v is not None else "-" for v in gpu]
            reference = _mib(base, "served", "gpu_used_mib") if base else None
            cells.append(f"{gpu[2] / reference:.2f}x" if gpu[2] is not None and reference else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Each configuration in a process of its own; the runs: each model's two warm-up sizes, with and "
              f"without the weights, {results['runs']} times from each thread; ONNX Runtime {results['onnxruntime']}."]
    if cuda:
        lines.append("GPU MiB: the GPU's used memory less before the process started (its CUDA context included).")
    return lines


def report(results: dict[str, Any], out: Path | None) -> None:
    lines = table(results)
    print("\n".join(lines))
    if out is not None:
        from tests.load.report import write_section

        write_section(out, f"worker-memory-{results['device']}", lines, stamp=results["date"],
                      command=results["command"], where=results["machine"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    parser.add_argument("--threads", type=int, default=2, help="inference threads (the service's default on 2 "
                        "cores or more: %(default)s)")
    parser.add_argument("--runs", type=int, default=20, help="rounds of runs from each thread (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a configuration (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=300, help="seconds for them all (default: %(default)s)")
    parser.add_argument("--results", type=Path, help="write the results (JSON) here")
    parser.add_argument("--report", action="store_true", help="print (and --out) the table of --results")
    parser.add_argument("--out", type=Path, help="markdown file to write the table into (worker-memory-<device>)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        try:
            result = worker(json.loads(args.worker))
        except Exception as e:  # a configuration ONNX Runtime refuses: a row of the table
            result = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        args.worker_out.write_text(json.dumps(result))
        return 0
    if args.report:
        if args.results is None:
            parser.error("--report needs --results")
        report(json.loads(args.results.read_text()), args.out)
        return 0
    if not any(args.repository.glob("*/config.json")):
        parser.error(f"{args.repository} holds no model: `make export` writes the default repository")
    results = sweep(args)
    if args.results:
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    print()
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
