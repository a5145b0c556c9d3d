"""What it costs dot_product's CPU graph to give its weights in the shape config.json declares, (batch, n_q,
n_k), rather than as its `Attention` node makes them, (batch, 1, n_q, n_k), which the service views
without the head's axis (export.repository.without_head_axis). The exported model.cpu.onnx (`as made`)
against the same graph with its weights leaving through a Reshape to (batch, n_q, n_k) (what exports
before 2026-11-26 did), through a Squeeze of axis 1, and through a Reshape inside each branch of the `If`.
One core, one thread; the graphs alternate call by call; medians; both forms of valid lengths.

    python bench/weights_copy.py [--repository model_repository] [--sizes 8x128 2x512 1x1024 1x2048]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
D = 64


def variant(path: Path, how: str) -> bytes:
    """model.cpu.onnx with its weights (the If's second output) reshaped to (batch, n_q, n_k) `how`."""
    model = onnx.load(str(path))
    graph = model.graph
    if how == "as made":
        return model.SerializeToString()
    choice = next(node for node in graph.node if node.op_type == "If")
    assert choice.output[1] == "attention_weights", "not the graph export/fused.py makes"
    shape = [helper.make_node("Shape", ["queries"], ["wc_batch_n_q"], start=0, end=2),
             helper.make_node("Shape", ["keys"], ["wc_n_k"], start=1, end=2),
             helper.make_node("Concat", ["wc_batch_n_q", "wc_n_k"], ["wc_shape"], axis=0)]
    at = list(graph.node).index(choice)
    for i, node in enumerate(shape):
        graph.node.insert(at + i, node)
    if how == "Reshape in the If":
        for attribute in choice.attribute:
            branch = attribute.g
            made = branch.output[1].name
            branch.node.append(helper.make_node("Reshape", [made, "wc_shape"], [made + "_3d"]))
            branch.output[1].CopyFrom(helper.make_tensor_value_info(made + "_3d", TensorProto.FLOAT,
                                                                    ["batch", "n_q", "n_k"]))
    else:
        choice.output[1] = "wc_made"
        if how == "Reshape":
            graph.node.append(helper.make_node("Reshape", ["wc_made", "wc_shape"], ["attention_weights"]))
        else:
            graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "wc_axis_1"))
            graph.node.append(helper.make_node("Squeeze", ["wc_made", "wc_axis_1"], ["attention_weights"]))
    weights = next(o for o in graph.output if o.name == "attention_weights")
    weights.CopyFrom(helper.make_tensor_value_info("attention_weights", TensorProto.FLOAT, ["batch", "n_q", "n_k"]))
    return model.SerializeToString()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--sizes", nargs="+", default=["8x128", "2x512", "1x1024", "1x2048"], metavar="BATCHxN")
    parser.add_argument("--seconds", type=float, default=4.0, help="a point's timing, each form of lengths")
    args = parser.parse_args()
    path = args.repository / "dot_product" / "1" / "model.cpu.onnx"
    if not path.is_file():
        print(f"no {path}: export first (python -m export)", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {0})
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    hows = ("as made", "Reshape", "Squeeze", "Reshape in the If")
    sessions = {how: ort.InferenceSession(variant(path, how), options, providers=["CPUExecutionProvider"])
                for how in hows}
    rng = np.random.default_rng(0)
    print(f"dot_product's model.cpu.onnx ({path}), ms a run and x as made; one core, one thread, medians\n")
    print("| batch x n_q x n_k x d | valid lengths | " + " | ".join(hows) + " |")
    print("| --- | --- |" + " ---: |" * len(hows))
    for size in args.sizes:
        batch, n = map(int, size.split("x"))
        for form in ("per example", "per query"):
            feed = {name: rng.standard_normal((batch, n, D), dtype=np.float32)
                    for name in ("queries", "keys", "values")}
            lens = rng.integers(1, n + 1, (batch, 1) if form == "per example" else (batch, n))
            feed["valid_lens"] = np.broadcast_to(lens, (batch, n)).astype(np.int64)
            made = sessions["as made"].run(None, feed)
            for how in hows[1:]:  # the same numbers, the head's axis aside
                out, weights = sessions[how].run(None, feed)
                assert np.array_equal(out, made[0]) and np.array_equal(weights, made[1][:, 0]), how
            times: dict[str, list[float]] = {how: [] for how in hows}
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                for how, session in sessions.items():
                    start = time.perf_counter()
                    session.run(None, feed)
                    times[how].append(time.perf_counter() - start)
            medians = {how: statistics.median(t) for how, t in times.items()}
            cells = [f"{1e3 * medians[how]:.3f} ({medians[how] / medians['as made']:.2f}x)" for how in hows]
            print(f"| {batch} x {n} x {n} x {D} | {form} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
