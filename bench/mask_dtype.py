"""What building the CPU graph's mask costs in ONNX Runtime, by the integer type it is compared in: the
subgraph of export/fused.py (valid lengths unsqueezed to (batch, 1, n_q, 1), `Range(0, n_k)`, `Less`)
alone, with the comparison in int64 and in int32 (the lengths and n_k cast first, as the served graph
does). One core, one thread; the two alternate call by call; medians.

    python bench/mask_dtype.py [--sizes 2x512 1x1024 1x2048] [--calls 301]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def mask_graph(dtype: int) -> bytes:
    numpy_type = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32}[dtype]
    nodes = [helper.make_node("Cast", ["valid_lens"], ["lens_t"], to=dtype),
             helper.make_node("Unsqueeze", ["lens_t", "axes"], ["lens"]),
             helper.make_node("Shape", ["keys"], ["n_k_1"], start=1, end=2),
             helper.make_node("Squeeze", ["n_k_1"], ["n_k_64"]),
             helper.make_node("Cast", ["n_k_64"], ["n_k"], to=dtype),
             helper.make_node("Range", ["zero", "n_k", "one"], ["positions"]),
             helper.make_node("Less", ["positions", "lens"], ["mask"])]
    inits = [numpy_helper.from_array(np.array([1, 3], np.int64), "axes"),
             numpy_helper.from_array(np.array(0, numpy_type), "zero"),
             numpy_helper.from_array(np.array(1, numpy_type), "one")]
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("valid_lens", TensorProto.INT64,
                                                                            ["batch", "n_q"]),
                                              helper.make_tensor_value_info("keys", TensorProto.FLOAT,
                                                                            ["batch", "n_k", "d"])],
                              [helper.make_tensor_value_info("mask", TensorProto.BOOL, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model.SerializeToString()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["2x512", "1x1024", "1x2048"], metavar="BATCHxN")
    parser.add_argument("--calls", type=int, default=301)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    sessions = {name: ort.InferenceSession(mask_graph(t), options, providers=["CPUExecutionProvider"])
                for name, t in (("int64", TensorProto.INT64), ("int32", TensorProto.INT32))}
    rng = np.random.default_rng(0)
    print("| batch x n_q x n_k | int64 us | int32 us | int32 / int64 |\n| --- | ---: | ---: | ---: |")
    for size in args.sizes:
        batch, n = (int(x) for x in size.split("x"))
        feed = {"valid_lens": rng.integers(0, n + 1, (batch, n)).astype(np.int64),
                "keys": np.zeros((batch, n, 1), np.float32)}
        masks = [s.run(None, feed)[0] for s in sessions.values()]
        if not np.array_equal(*masks):
            raise SystemExit(f"the two masks differ at {size}")
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.calls):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, feed)
                times[name].append(time.perf_counter() - start)
        a, b = (1e6 * statistics.median(times[name]) for name in ("int64", "int32"))
        print(f"| {batch} x {n} x {n} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
