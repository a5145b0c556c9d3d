"""The CPU graph of the dot-product family: ONNX's `Attention` operator (opset 24) in place of the traced
MatMul, Mul, Where, Softmax, Where, MatMul, built from the same module's weights and served only on ONNX
Runtime's CPU execution provider (config.json's `variants["cpu"]`); and its twin without the
attention_weights output (`weights=False`, model.cpu.outputs.onnx, `variants["cpu_outputs"]`), which the
service runs for a batch that returns no weights: its nodes do not copy the weights out.

Why a second graph: on the CPU the node is one kernel that keeps the scores in one buffer (the mask
added, the softmax taken in place), where the traced graph makes a new (batch, heads, n_q, n_k) tensor at
each of its steps; `python bench/compute.py` measures both. Why not the only graph: ONNX Runtime's CUDA kernel of
`Attention` refuses `qk_matmul_output_mode` 3 (NOT_IMPLEMENTED in 1.31), and the weights output is
part of every answer; model.onnx, the traced graph, stays what every other execution provider runs for
a batch that wants them. For one that does not, CUDA has a graph of its own (below).

The graph takes what the traced one takes and answers the same, name for name and axis for axis
(`export.repository.signature`):

- valid_lens come 2-D, (batch, n_q) int64 (1-D and absent lengths are made 2-D before, `valid_lens_2d`).
  An `If` chooses between two `Attention` nodes by their form:
  - each row one length (1-D lengths, absent ones, and the batcher's padded query rows, which repeat
    their request's last length): the lengths, clipped to [0, n_k], go in as the node's
    `nonpad_kv_seqlen` (opset 24), which masks the keys past each example's length in the kernel, so no
    mask is built. At n = 512 to 2048 this saves about a fifth of dot_product's time (less of
    multi_head's, whose projections it does not touch): the kernel turns a boolean mask into an
    additive one, then copies it into the scores of each head (`python bench/compute.py`, its rows "per
    example" and "per query");
  - lengths per query: the mask `arange(n_k) < valid_lens`, built in the graph as models.masked_softmax
    does, compared as int32 (about half the time of int64, `python bench/mask_dtype.py`).
  The choice costs three small reductions, a Sub and an Equal over the (batch, n_q) lengths, and the
  `If`: a few microseconds.
- `qk_matmul_output_mode` = 3 makes the node's fourth output the post-softmax weights;
- the scale is the node's default, 1/sqrt(head size), the book's 1/sqrt(d);
- a query of valid length 0 (or less) attends to nothing, which the operator makes a zero row of the
  output and of the mode-3 weights (the errata in onnx 1.23's text of `Attention`; ONNX Runtime's CPU
  kernel does so in both branches): zeros, as models.masked_softmax makes them (not the book's uniform
  weights). The validator's sweep (export.validate) checks both branches on every export: its 1-D and
  absent lengths take the first, its 2-D ones the second.
- multi_head's weights (and self_attention's) leave the graph as the node makes them, (batch, heads,
  n_q, n_k). onnx's shape inference (1.23) sizes their n_k 0, the size ONNX Runtime then reports for the
  output: the service reads a 0 where config.json names an axis as that name
  (`export.repository.shape_agrees`), and runs the graph at log severity "error", since ONNX Runtime
  warns at every run that the real shape is not 0 (`CPU_GRAPH_LOG_SEVERITY`). A Reshape to a shape
  computed from the inputs would name the axis, at the cost of a copy of the weights (ONNX Runtime
  copies where a Reshape's output is the graph's; docs/benchmarks.md, "Compute", has multi_head's time
  with and without it). dot_product's weights leave as the node makes them too, with the axis of its one
  head: (batch, 1, n_q, n_k), which config.json declares (batch, n_q, n_k) and whoever runs the graph views
  without that axis (`export.repository.one_head_axis`, `without_head_axis`: a Reshape here copied them,
  2-10% of the graph's time, the most at the largest n: `python bench/weights_copy.py`). dot_product's Y,
  with a 0 for value_size, leaves through a Reshape to its shape from the inputs (n_q x value_size
  numbers: no time to speak of); multi_head's Y is sized right (num_hiddens is a number).

The CUDA graph (`cuda=True`, model.cuda.outputs.onnx, `variants["cuda_outputs"]`): the same model without
the weights, for the batches that return none on ONNX Runtime's CUDA execution provider, where the
`Attention` node runs on a fused kernel (onnxruntime/core/providers/cuda/llm/attention.cc, 1.31: Flash
for fp16/bf16 only; memory-efficient attention, cutlass's, for fp32 too, where the head sizes of Q, K
and V are multiples of 8 up to 1024 and no weights are asked for, a mask only where n_k is a multiple of
4; else its unfused kernel, which writes the scores). It differs from the CPU's graph where CUDA needs it:

- multi_head's and self_attention's heads are padded to a multiple of 8 (the book's 100 / 5 = 20 to
  24): each head's columns of W_q, W_k, W_v get zero columns after them, W_o zero rows to match, so
  the padded features add zeros to every dot product and the padded outputs meet zero weights; the
  scale is set to 1/sqrt(the real head size), not the node's default of the padded one. On the CPU
  the padding would be a fifth more work for nothing: its kernel takes any head size.
- a query of valid length 0 gets a zero row after the `If` (a Where): CUDA's kernels do not all make
  one (the unfused kernel gives a row with no key the mean of V; the memory-efficient one too, for a
  row the mask takes whole), the CPU's kernel does.
- the node has no qk_matmul_output_mode: no weights output.

1-D lengths go in as nonpad_kv_seqlen, 2-D ones through the mask, as in the CPU's graph: CUDA's kernel
turns a boolean mask into an additive bias of (batch, 1, n_q, n_k) floats, memory quadratic in n but once
for all heads, and still no score matrix where the memory-efficient kernel runs.

The fp16 form (`half=True`, a bench's graph, not served: `python bench/longseq.py` measures whether it
pays): the CUDA graph with Q, K and V cast to fp16 for the `Attention` node and Y cast back, which
Flash attention takes (fp16 only). The projections and W_o stay fp32. No -1e6 is added in fp16 (it
overflows): lengths one an example mask in the kernel, per query through a boolean mask. The values
and scores of a request must fit fp16 (+-65504), masked keys' too: past it they become inf, and the
outputs NaN on the CPU's kernel (tests/export/test_fused.py). A served form would check that first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from export.errors import ExportError
from export.repository import signature

__all__ = ["FUSED_KINDS", "HALF_TOLERANCE", "HEAD_MULTIPLE", "OPSET", "export_fused", "fused_graph",
           "padded_head_size"]

OPSET = 24  # Attention is an operator from opset 23 on; nonpad_kv_seqlen, from 24
FUSED_KINDS = ("dot_product", "multi_head", "self_attention")
# CUDA's fused kernels of `Attention` take head sizes that are multiples of this (flash::is_supported and
# has_memory_efficient_attention in ONNX Runtime 1.31): the CUDA graph pads its heads to one.
HEAD_MULTIPLE = 8
# The fp16 form's outputs against PyTorch's fp32, absolute and relative: fp16 keeps 11 bits (a rounding
# is up to 4.9e-4 of a value), and Q, K, V, the weights and Y are each rounded once (the validator's
# sweep on the CPU: at most 1.2e-3).
HALF_TOLERANCE = 2e-3
_TYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}


class _Graph:
    """Nodes and initializers, with fresh names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | list[str], **attrs: Any) -> str:
        outputs = [output] if isinstance(output, str) else output
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=outputs[0], **attrs))
        return outputs[0]

    def subgraph(self, name: str, outputs: dict[str, list[str | int]], dtype: int = TensorProto.FLOAT
                 ) -> onnx.GraphProto:
        """These nodes as a branch of an `If`: no inputs of its own (it reads the outer graph's names),
        `outputs` its results by name and shape, of `dtype`."""
        return helper.make_graph(self.nodes, name, [], [
            helper.make_tensor_value_info(n, dtype, shape) for n, shape in outputs.items()])

    def linear(self, x: str, layer: nn.Linear, name: str, output: str | None = None,
               pad: tuple[int, int, int] | None = None, rows: bool = False) -> str:
        """x @ W.T (+ b), as nn.Linear; the result named `output` (default: "<name>.out"). With `pad`
        (heads, head size, padded head size), W.T's columns and b (its rows, with `rows`) split into heads,
        each followed by zeros up to the padded size (`_pad_heads`)."""
        output = output or f"{name}.out"
        weight = layer.weight.detach().to("cpu").numpy().T.copy()  # (in, out)
        bias = None if layer.bias is None else layer.bias.detach().to("cpu").numpy().copy()
        if pad is not None:
            weight = _pad_heads(weight, *pad, axis=0 if rows else 1)
            if bias is not None and not rows:
                bias = _pad_heads(bias, *pad, axis=0)
        y = self.op("MatMul", [x, self.const(f"{name}.weight", weight)], output if bias is None else f"{name}.matmul")
        if bias is not None:
            y = self.op("Add", [y, self.const(f"{name}.bias", bias)], output)
        return y


def padded_head_size(head: int) -> int:
    """`head` rounded up to a multiple of HEAD_MULTIPLE: the CUDA graph's head size."""
    return -(-head // HEAD_MULTIPLE) * HEAD_MULTIPLE


def _pad_heads(array: np.ndarray, heads: int, head: int, padded: int, axis: int) -> np.ndarray:
    """`array` with its `axis` (heads x head long, head after head) made heads x padded: each head's
    entries, then zeros."""
    moved = np.moveaxis(array, axis, 0)
    out = np.zeros((heads, padded, *moved.shape[1:]), dtype=array.dtype)
    out[:, :head] = moved.reshape((heads, head, *moved.shape[1:]))
    return np.ascontiguousarray(np.moveaxis(out.reshape((heads * padded, *moved.shape[1:])), 0, axis))


def fused_graph(kind: str, module: nn.Module, hp: dict[str, Any], weights: bool = True,
                cuda: bool = False, half: bool = False) -> onnx.ModelProto:
    """The `Attention`-node graph of `module` (a models.DotProductAttention, MultiHeadAttention or
    SelfAttention of `kind` with hyperparameters `hp`), with `signature(kind, hp)`'s inputs and outputs;
    without `attention_weights` where `weights` is False (model.cpu.outputs.onnx: the nodes then do not
    copy the weights out); with `cuda`, the CUDA graph (model.cuda.outputs.onnx: no weights, heads padded
    to a multiple of 8, zero rows for valid length 0); with `half` too, its `Attention` in fp16 (the module's
    text, "The fp16 form")."""
    if kind not in FUSED_KINDS:
        raise ExportError(f"no fused graph for kind {kind!r}; only for {', '.join(FUSED_KINDS)}")
    if cuda and weights:
        raise ExportError("the CUDA graph has no attention_weights output (CUDA's kernel cannot return them)")
    if half and not cuda:
        raise ExportError("only the CUDA graph has an fp16 form (for CUDA's Flash kernel)")
    inputs, outputs = signature(kind, hp)
    if not weights:
        outputs = [s for s in outputs if s.name != "attention_weights"]
    g = _Graph()
    heads = 1 if kind == "dot_product" else int(hp["num_heads"])
    queries = "queries"
    keys, values = ("queries", "queries") if kind == "self_attention" else ("keys", "values")

    if kind == "self_attention":
        # X + P[:n], P the module's own table (max_len rows): a longer sequence fails to broadcast,
        # as in the traced graph (the service refuses n > max_len before).
        table = module.pos_encoding.P.detach().to("cpu").numpy()[0]  # (max_len, num_hiddens)
        n = g.op("Shape", [queries], "n", start=1, end=2)
        rows = g.op("Slice", [g.const("P", table), g.const("zero_1", np.array([0], np.int64)), n,
                              g.const("axis_0", np.array([0], np.int64))], "P_n")
        queries = keys = values = g.op("Add", ["queries", rows], "X")

    n_k_1 = g.op("Shape", [keys], "n_k_1", start=1, end=2)  # [n_k]
    n_k_64 = g.op("Squeeze", [n_k_1], "n_k_64")
    head = 0 if kind == "dot_product" else int(hp["num_hiddens"]) // heads
    # The CUDA graph's heads: a multiple of 8, for CUDA's fused kernels (dot_product's d is the caller's).
    pad = (heads, head, padded_head_size(head)) if cuda and head and head % HEAD_MULTIPLE else None
    if kind == "dot_product":
        q, k, v = queries, keys, values
    else:
        q = g.linear(queries, module.W_q, "W_q", pad=pad)
        k = g.linear(keys, module.W_k, "W_k", pad=pad)
        v = g.linear(values, module.W_v, "W_v", pad=pad)
    # 3-D Q, K, V: the node splits the last axis into heads and joins them again in Y, as
    # MultiHeadAttention's _split_heads and its transpose-reshape do. Its weights are (batch, heads,
    # n_q, n_k), the graph's output as they are: dot_product's with the axis of its one head, which
    # config.json does not declare (export.repository.one_head_axis).
    if half:  # Q, K and V in fp16 for the node alone; Y back to fp32 after it
        cast = {x: g.op("Cast", [x], f"{x}.fp16", to=TensorProto.FLOAT16) for x in dict.fromkeys((q, k, v))}
        q, k, v = cast[q], cast[k], cast[v]
    y, scores = "attended", "attention_weights"
    attention: dict[str, Any] = {"q_num_heads": heads, "kv_num_heads": heads}
    if not cuda:
        attention["qk_matmul_output_mode"] = 3
    elif head:  # the book's 1/sqrt(head size): the node's default would take the padded one's
        attention["scale"] = float(1 / np.sqrt(head))
    y_shape = ["batch", "n_q", "value_size" if kind == "dot_product" else heads * (pad[2] if pad else head)]
    w_shape = ["batch", heads, "n_q", "n_k"]

    # Lengths per example (each row of valid_lens one number: 1-D lengths, absent ones, the batcher's
    # padded query rows): the node's nonpad_kv_seqlen, the first keys of each example, and no mask.
    longest = g.op("ReduceMax", ["valid_lens", g.const("axis_1", np.array([1], np.int64))], "longest", keepdims=0)
    shortest = g.op("ReduceMin", ["valid_lens", "axis_1"], "shortest", keepdims=0)
    spread = g.op("ReduceMax", [g.op("Sub", [longest, shortest], "spreads")], "spread", keepdims=0)
    per_example = g.op("Equal", [spread, g.const("zero_64", np.array(0, np.int64))], "per_example")
    by_length = _Graph()
    kv_lens = by_length.op("Clip", [longest, "zero_64", n_k_64], "kv_lens")  # in [0, n_k], as the mask reads them
    kept = 4 if weights else 1  # the node's outputs: Y, and the weights as its fourth
    by_length.op("Attention", [q, k, v, "", "", "", kv_lens], ["y_by_length", "", "", "w_by_length"][:kept],
                 **attention)

    # Lengths per query: the mask arange(n_k) < valid_lens, True = attend, built in the graph as
    # models.masked_softmax builds it. Compared as int32: ONNX Runtime builds the (batch, n_q, n_k) mask in
    # about half the time it takes in int64 (`python bench/mask_dtype.py`); lengths are at most n_k.
    by_mask = _Graph()
    lens_32 = by_mask.op("Cast", ["valid_lens"], "lens_32", to=TensorProto.INT32)
    lens = by_mask.op("Unsqueeze", [lens_32, g.const("axes_1_3", np.array([1, 3], np.int64))], "lens")  # (b, 1, n_q, 1)
    n_k = by_mask.op("Cast", [n_k_64], "n_k", to=TensorProto.INT32)
    positions = by_mask.op("Range", [g.const("zero", np.array(0, np.int32)), n_k,
                                     g.const("one", np.array(1, np.int32))], "positions")  # (n_k,)
    mask = by_mask.op("Less", [positions, lens], "mask")  # (batch, 1, n_q, n_k)
    by_mask.op("Attention", [q, k, v, mask], ["y_by_mask", "", "", "w_by_mask"][:kept], **attention)

    by_length_out, by_mask_out = {"y_by_length": y_shape}, {"y_by_mask": y_shape}
    if weights:
        by_length_out["w_by_length"] = by_mask_out["w_by_mask"] = w_shape
    node_type = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    g.op("If", [per_example], [f"{y}_fp16" if half else f"{y}_by_if" if cuda else y, scores][:2 if weights else 1],
         then_branch=by_length.subgraph("by_length", by_length_out, node_type),
         else_branch=by_mask.subgraph("by_mask", by_mask_out, node_type))
    if half:
        g.op("Cast", [f"{y}_fp16"], f"{y}_by_if", to=TensorProto.FLOAT)
    if cuda:  # a query of valid length 0 attends to nothing: a zero row, which CUDA's kernels do not all make
        attends = g.op("Unsqueeze", [g.op("Greater", ["valid_lens", "zero_64"], "attends_2d"),
                                     g.const("axis_2", np.array([2], np.int64))], "attends")  # (batch, n_q, 1)
        g.op("Where", [attends, f"{y}_by_if", g.const("zero_f", np.array(0, np.float32))], y)

    if kind == "dot_product":  # Y reshaped to its shape from the inputs; the weights as the node makes them
        batch_n_q = g.op("Shape", [queries], "batch_n_q", start=0, end=2)  # [batch, n_q]
        value_size = g.op("Shape", [values], "value_size", start=2, end=3)
        out_shape = g.op("Concat", [batch_n_q, value_size], "out_shape", axis=0)
        g.op("Reshape", [y, out_shape], "outputs")
    else:  # Y's last axis is num_hiddens (or its padded heads), a number: shape inference sizes it right
        g.linear(y, module.W_o, "W_o", output="outputs", pad=pad, rows=True)

    graph = helper.make_graph(
        g.nodes, f"{kind}_fused_cuda{'_fp16' if half else ''}" if cuda else f"{kind}_fused",
        [helper.make_tensor_value_info(s.name, _TYPES[s.dtype], list(s.shape)) for s in inputs],
        [helper.make_tensor_value_info(s.name, _TYPES[s.dtype], w_shape if (kind, s.name) == ("dot_product", scores)
                                       else list(s.shape)) for s in outputs],
        g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="attend export.fused")
    model.ir_version = 10  # what ONNX Runtime reads from 1.2x on; onnx's checker takes opset 24 at it
    return model


def export_fused(module: nn.Module, kind: str, hp: dict[str, Any], path: Path, weights: bool = True,
                 cuda: bool = False, half: bool = False) -> int:
    """Write `module`'s fused graph (without the weights where `weights` is False; CUDA's with `cuda`, in
    fp16 with `half`) to `path` (one self-contained file); returns the opset."""
    model = fused_graph(kind, module, hp, weights, cuda, half)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise ExportError(f"the fused graph of {kind} is not valid ONNX: {e}") from e
    onnx.save(model, str(path))
    return OPSET
