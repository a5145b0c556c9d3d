"""Compute on long sequences (issue 25, "Long sequences"): the served ONNX graphs of dot_product and
multi_head, run by ONNX Runtime as the service runs them, against the book's modules in eager PyTorch
and against a single ONNX `Attention` node (opset 23, `qk_matmul_output_mode` = 3: the post-softmax
weights as its second output) fed the same inputs, its boolean mask built in the graph from the same
2-D int64 valid lengths the service feeds.

One core (os.sched_setaffinity), one thread (torch.set_num_threads(1), ORT intra_op_num_threads=1);
random inputs, random valid lengths from 1 to n (no fully masked rows in the timings: they are checked
apart, on a small case); the three runs alternate call by call, and a figure is the median of the
repeats. Each row also checks the outputs and weights against PyTorch (max abs diff) and that the
Attention node gives the masked keys a weight of exactly 0.

    python bench/compute.py [--repeats 41] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from export.build import build_module  # noqa: E402
from service.core.runtime import Registry  # noqa: E402
from tests.load.report import write_section  # noqa: E402

SECTION = "compute"
# (batch, n): the batch shrinks as n grows.
SIZES = [(8, 128), (4, 256), (2, 512), (1, 1024), (1, 2048)]
D = 64  # dot_product's features (queries, keys and values)


def session_options() -> ort.SessionOptions:
    """What service.core.runtime gives a model's session, with one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def attention_graph(kind: str, module: torch.nn.Module | None, hp: dict) -> onnx.ModelProto:
    """queries, keys, values, valid_lens (batch, n_q) int64 -> outputs, attention_weights, as the
    served graph, through one `Attention` node: the mask `arange(n_k) < valid_lens` is built in the
    graph; for multi_head the projections W_q, W_k, W_v before it and W_o after it are MatMuls with
    the module's weights, the node splitting and joining the heads itself (3-D Q, K, V)."""
    heads = int(hp.get("num_heads", 1))
    f = "features"
    nodes = [
        helper.make_node("Unsqueeze", ["valid_lens", "axes_1_3"], ["lens4"]),  # (batch, 1, n_q, 1)
        helper.make_node("Shape", ["keys"], ["n_k1"], start=1, end=2),
        helper.make_node("Squeeze", ["n_k1"], ["n_k"]),
        helper.make_node("Range", ["zero", "n_k", "one"], ["positions"]),  # (n_k,)
        helper.make_node("Less", ["positions", "lens4"], ["mask"]),  # (batch, 1, n_q, n_k), True = attend
    ]
    inits = [numpy_helper.from_array(np.array([1, 3], np.int64), "axes_1_3"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    if kind == "multi_head":
        for name in ("W_q", "W_k", "W_v", "W_o"):
            weight = getattr(module, name).weight.detach().numpy().T.copy()  # x @ W.T
            inits.append(numpy_helper.from_array(weight, name))
        nodes += [helper.make_node("MatMul", ["queries", "W_q"], ["q"]),
                  helper.make_node("MatMul", ["keys", "W_k"], ["k"]),
                  helper.make_node("MatMul", ["values", "W_v"], ["v"])]
        q, k, v, y = "q", "k", "v", "y"
        f = hp["num_hiddens"]
    else:
        q, k, v, y = "queries", "keys", "values", "outputs"
    # Outputs: Y, present_key, present_value (unused), qk_matmul_output (mode 3: softmax(...)).
    nodes.append(helper.make_node("Attention", [q, k, v, "mask"], [y, "", "", "weights4"],
                                  q_num_heads=heads, kv_num_heads=heads, qk_matmul_output_mode=3))
    if kind == "multi_head":
        nodes.append(helper.make_node("MatMul", ["y", "W_o"], ["outputs"]))
        nodes.append(helper.make_node("Identity", ["weights4"], ["attention_weights"]))  # (batch, heads, n_q, n_k)
        weights_shape = ["batch", heads, "n_q", "n_k"]
    else:
        nodes.append(helper.make_node("Squeeze", ["weights4", "axes_1"], ["attention_weights"]))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes_1"))
        weights_shape = ["batch", "n_q", "n_k"]
    fq = fk = fv = f
    fo = f if kind == "multi_head" else "value_size"
    graph = helper.make_graph(
        nodes, f"{kind}_attention_node",
        [helper.make_tensor_value_info("queries", TensorProto.FLOAT, ["batch", "n_q", fq]),
         helper.make_tensor_value_info("keys", TensorProto.FLOAT, ["batch", "n_k", fk]),
         helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", "n_k", fv if kind == "multi_head"
                                                                     else "value_size"]),
         helper.make_tensor_value_info("valid_lens", TensorProto.INT64, ["batch", "n_q"])],
        [helper.make_tensor_value_info("outputs", TensorProto.FLOAT, ["batch", "n_q", fo]),
         helper.make_tensor_value_info("attention_weights", TensorProto.FLOAT, weights_shape)],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def inputs(kind: str, batch: int, n: int, hp: dict, rng: np.random.Generator,
           lens: np.ndarray | None = None) -> dict[str, np.ndarray]:
    f = hp["num_hiddens"] if kind == "multi_head" else D
    feed = {name: rng.standard_normal((batch, n, f), dtype=np.float32) for name in ("queries", "keys", "values")}
    feed["valid_lens"] = rng.integers(1, n + 1, size=(batch, n), dtype=np.int64) if lens is None else lens
    return feed


def torch_call(module: torch.nn.Module, feed: dict[str, np.ndarray]) -> Callable[[], tuple]:
    args = [torch.from_numpy(feed[name]) for name in ("queries", "keys", "values", "valid_lens")]

    def call() -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            out, weights = module(*args)
        return out.numpy(), weights.numpy()
    return call


def ort_call(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> Callable[[], list]:
    return lambda: session.run(["outputs", "attention_weights"], feed)


def timed(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each, the calls alternating (one warm-up each first)."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for label, call in calls.items():
            start = time.perf_counter()
            call()
            times[label].append((time.perf_counter() - start) * 1e3)
    return {label: statistics.median(values) for label, values in times.items()}


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def masked_nonzero(weights: np.ndarray, lens: np.ndarray) -> float:
    """The largest |weight| at a masked key (position >= valid_len): 0.0 when exactly zero."""
    n_k = weights.shape[-1]
    masked = np.arange(n_k) >= lens[:, None, :, None] if weights.ndim == 4 else np.arange(n_k) >= lens[..., None]
    return float(np.abs(np.where(masked, weights, 0)).max())


def fully_masked(kind: str, hp: dict, module: torch.nn.Module, served: ort.InferenceSession,
                 node: ort.InferenceSession) -> str:
    """What each gives a query of valid length 0 (the timings have none): batch 2 x n 8, one row at 0."""
    lens = np.array([[3, 0, 8, 1, 5, 0, 2, 7], [0] * 8], dtype=np.int64)
    feed = inputs(kind, 2, 8, hp, np.random.default_rng(1), lens)
    runs = {"PyTorch": torch_call(module, feed)(), "served": ort_call(served, feed)(),
            "Attention": ort_call(node, feed)()}
    zero = lens == 0
    parts = []
    for label, (out, weights) in runs.items():
        out_rows = out[zero]
        w_rows = weights[zero] if weights.ndim == 3 else weights.transpose(0, 2, 1, 3)[zero]
        if np.isnan(out_rows).any() or np.isnan(w_rows).any():
            what = "NaN"
        elif not out_rows.any() and not w_rows.any():
            what = "zero output and weights"
        else:
            what = f"output max |{np.abs(out_rows).max():.3g}|, weights max {np.abs(w_rows).max():.3g}"
        parts.append(f"{label}: {what}")
    return f"{kind}, rows of valid length 0: " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--repeats", type=int, default=41, help="timed calls of each run per point (median)")
    parser.add_argument("--kinds", nargs="+", default=["dot_product", "multi_head"])
    parser.add_argument("--out", type=Path, help=f"markdown file to write the table into (section {SECTION})")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    # onnx's shape inference gives the Attention node's qk_matmul_output a last axis of 0 where n_k is
    # symbolic, and ORT warns at every run that the real shape differs: quiet, the figures unaffected.
    ort.set_default_logger_severity(3)
    load = os.getloadavg()[0]
    registry = Registry.load(args.repository, "cpu", 1)

    rows, notes = [], []
    started = time.perf_counter()
    for kind in args.kinds:
        served_model = registry.get(kind)
        hp = dict(served_model.config.hyperparameters)
        torch.manual_seed(0)  # as export.publish does for the default repository (seed 0)
        module = build_module(kind, hp)
        served = served_model.session
        node = ort.InferenceSession(attention_graph(kind, module, hp).SerializeToString(), session_options(),
                                    providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        for batch, n in SIZES:
            feed = inputs(kind, batch, n, hp, rng)
            calls = {"torch": torch_call(module, feed), "served": ort_call(served, feed),
                     "node": ort_call(node, feed)}
            ref_out, ref_w = calls["torch"]()
            s_out, s_w = calls["served"]()
            a_out, a_w = calls["node"]()
            ms = timed(calls, args.repeats)
            shape = f"{batch} x {n} x {n} x {D}" if kind == "dot_product" else \
                f"{batch} x {n} x {n} x {hp['num_hiddens']}, {hp['num_heads']} heads"
            rows.append(
                f"| {kind} | {shape} | {ms['torch']:.2f} | {ms['served']:.2f} | {ms['served'] / ms['torch']:.2f} "
                f"| {diff(s_out, ref_out):.1e} / {diff(s_w, ref_w):.1e} "
                f"| {ms['node']:.2f} | {ms['node'] / ms['torch']:.2f} | {ms['node'] / ms['served']:.2f} "
                f"| {diff(a_out, ref_out):.1e} / {diff(a_w, ref_w):.1e} "
                f"| {masked_nonzero(a_w, feed['valid_lens']):.1g} |")
            print(rows[-1], flush=True)
        notes.append(fully_masked(kind, hp, module, served, node))

    table = [
        "| model | batch x n_q x n_k x features | PyTorch ms | served ms | served / PyTorch "
        "| served max diff (outputs / weights) | Attention node ms | node / PyTorch | node / served "
        "| node max diff (outputs / weights) | node's largest masked weight |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Medians of {args.repeats} calls each, the three alternating; one core, one thread; ORT {ort.__version__}, "
        f"torch {torch.__version__}; load average {load:.2f} at the start (2 would be both cores busy). Max diffs "
        "are against the PyTorch module's outputs and weights; the node's masked weights are those of keys at "
        "positions >= valid_len.",
        "",
        *[f"- {note}" for note in notes],
    ]
    print()
    print("\n".join(table))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.out:
        write_section(args.out, SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
