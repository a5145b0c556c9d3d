"""Why ONNX Runtime's CPU `Attention` kernel is slow on some x86 CPUs: the exponentials of the masked scores
underflow, and where the CPU takes a microcode assist for a result that underflows (Intel's cores, with
MXCSR's flush-to-zero bit clear, as every thread starts), each vector of them costs a few hundred cycles.

ONNX Runtime fills a masked score with the lowest float (the kernel, for `nonpad_kv_seqlen` and for a
boolean mask) and the traced graph with the book's -1e6; both then go through MLAS's softmax
(MlasComputeSoftmax). On a CPU with AVX-512F, MLAS's exponential (MlasComputeSumExpF32KernelAvx512F)
clamps its input at -103.97 and scales by 2^m with VSCALEFPS, so every masked score's exponential
underflows to 0; the AVX2/FMA3 kernel clamps at -88.38 and builds 2^m as an integer (0 for the
lowest), which does not underflow. This times each part with MXCSR's flush-to-zero bit clear and set
(glibc's fegetenv/fesetenv, this thread), call by call: the `Attention` node (lengths per example, all
keys, a boolean mask per query), ONNX Runtime's Softmax on masked and unmasked scores, and the served
graphs (model.cpu.onnx, model.onnx) of an exported repository. One core, one thread, medians.

    python bench/underflow.py [--sizes 1x1024 2x512] [--calls 101] [--repository model_repository]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.core import denormals  # noqa: E402
from tests.load.report import write_section  # noqa: E402

SECTION = "underflow"


def flush_to_zero(on: bool) -> None:
    """Set or clear MXCSR's flush-to-zero bit of this thread (the service sets it with DAZ: service.core.denormals)."""
    denormals.set_flush(on, denormals.FTZ)


def session(source: bytes | str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def one_node(op: str, names: list[str], inputs: list[tuple[str, int]], outputs: list[str], **attrs: object
             ) -> ort.InferenceSession:
    """A graph of one `op` node reading `names` ("" for an input left out) from `inputs` (name, type)."""
    graph = helper.make_graph([helper.make_node(op, names, outputs, **attrs)], op,
                              [helper.make_tensor_value_info(name, t, None) for name, t in inputs],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                               for name in outputs if name])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return session(model.SerializeToString())


def timed(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each, FTZ clear and set, the calls alternating (the order turning round by round)."""
    runs = [(f"{label}|{on}", on, call) for label, call in calls.items() for on in (False, True)]
    times: dict[str, list[float]] = {key: [] for key, _, _ in runs}
    for round_ in range(repeats + 1):
        turn = round_ % len(runs)
        for key, on, call in runs[turn:] + runs[:turn]:
            flush_to_zero(on)
            start = time.perf_counter()
            call()
            if round_:
                times[key].append((time.perf_counter() - start) * 1e3)
    flush_to_zero(False)
    return {key: statistics.median(values) for key, values in times.items()}


def parts(batch: int, n: int, heads: int, head: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """The `Attention` node (3-D inputs, as export.fused feeds it, weights out) and Softmax, on random inputs."""
    f = heads * head
    q, k, v = (rng.standard_normal((batch, n, f), dtype=np.float32) for _ in range(3))
    lens = rng.integers(1, n + 1, size=batch, dtype=np.int64)
    mask = np.arange(n)[None, None, None, :] < rng.integers(1, n + 1, size=(batch, 1, n, 1))
    F, L, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    common = {"q_num_heads": heads, "kv_num_heads": heads, "qk_matmul_output_mode": 3}
    by_length = one_node("Attention", ["q", "k", "v", "", "", "", "l"], [("q", F), ("k", F), ("v", F), ("l", L)],
                         ["y", "", "", "w"], **common)
    by_mask = one_node("Attention", ["q", "k", "v", "m"], [("q", F), ("k", F), ("v", F), ("m", B)],
                       ["y", "", "", "w"], **common)
    softmax = one_node("Softmax", ["x"], [("x", F)], ["y"], axis=-1)
    scores = rng.standard_normal((batch, heads, n, n), dtype=np.float32)
    masked = np.where(np.broadcast_to(mask, scores.shape), scores, np.float32(-1e6))
    qkv = {"q": q, "k": k, "v": v}
    return {
        "Attention, lengths per example": lambda: by_length.run(None, qkv | {"l": lens}),
        "Attention, all keys (lengths n)": lambda: by_length.run(None, qkv | {"l": np.full(batch, n, np.int64)}),
        "Attention, boolean mask per query": lambda: by_mask.run(None, qkv | {"m": mask}),
        "Softmax, scores masked with -1e6": lambda: softmax.run(None, {"x": masked}),
        "Softmax, scores unmasked": lambda: softmax.run(None, {"x": scores}),
    }


def graphs(repository: Path, kind: str, batch: int, n: int, rng: np.random.Generator
           ) -> dict[str, Callable[[], object]]:
    """model.cpu.onnx and model.onnx of `kind`, lengths per example (random) and all keys."""
    import json

    config = json.loads((repository / kind / "config.json").read_text())
    f = config["hyperparameters"].get("num_hiddens", 64)
    feed = {name: rng.standard_normal((batch, n, f), dtype=np.float32) for name in ("queries", "keys", "values")}
    lens = np.repeat(rng.integers(1, n + 1, size=(batch, 1)), n, axis=1)
    calls = {}
    for label, file in (("model.cpu.onnx", config["variants"]["cpu"]["file"]), ("model.onnx", config["model_file"])):
        s = session(str(repository / kind / file))
        calls[f"{kind} {label}, lengths per example"] = lambda s=s: s.run(None, feed | {"valid_lens": lens})
        calls[f"{kind} {label}, all keys"] = lambda s=s: s.run(None, feed | {"valid_lens": np.full_like(lens, n)})
    return calls


def cpu_flags() -> str:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return ", ".join(f for f in ("avx2", "fma", "avx512f", "amx_tile") if f in flags) or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1x1024", "2x512"], metavar="BATCHxN")
    parser.add_argument("--calls", type=int, default=101)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--out", type=Path, help=f"markdown file to write the table into (section {SECTION})")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    rng = np.random.default_rng(0)
    rows = []
    for size in args.sizes:
        batch, n = (int(x) for x in size.split("x"))
        for shape, heads, head in ((f"{batch} x {n}, 1 head of 64", 1, 64), (f"{batch} x {n}, 5 heads of 20", 5, 20)):
            calls = parts(batch, n, heads, head, rng)
            if (args.repository / "dot_product" / "config.json").is_file():
                calls |= graphs(args.repository, "dot_product" if heads == 1 else "multi_head", batch, n, rng)
            ms = timed(calls, args.calls)
            for label in calls:
                off, on = ms[f"{label}|False"], ms[f"{label}|True"]
                rows.append(f"| {shape} | {label} | {off:.3f} | {on:.3f} | {off / on:.2f} |")
                print(rows[-1], flush=True)
    table = ["| batch x n | what | FTZ clear ms | FTZ set ms | clear / set |", "| --- | --- | ---: | ---: | ---: |",
             *rows, "", f"Medians of {args.calls} calls each, alternating call by call; one core, one thread; ONNX "
             f"Runtime {ort.__version__}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f} at the end."]
    if args.out:
        write_section(args.out, SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
