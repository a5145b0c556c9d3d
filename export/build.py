"""PyTorch side of the export: build a module from kind + hyperparameters, load a checkpoint,
and write it to ONNX with the dynamic axes that `export.repository.signature` declares."""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from export.errors import CheckpointError, ExportError
from export.repository import example_feed, signature
from models import (
    AdditiveAttention,
    DotProductAttention,
    MaskedSoftmax,
    MultiHeadAttention,
    SelfAttention,
    SinusoidalEncoding,
)

__all__ = ["build_module", "export_onnx", "load_checkpoint", "make_inputs", "read_state_dict", "sizes_from_state"]

# Each export logs that torchvision's operators are skipped: true, and of no concern here.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

# Sizes of the example inputs that the exporter traces with: distinct, and neither 0 nor 1,
# so that torch.export cannot specialise an axis or mistake one axis for another.
_EXAMPLE_SIZES = {"batch": 3, "n_q": 4, "n_k": 5, "n": 6, "d": 8, "value_size": 9}


def build_module(kind: str, hp: dict[str, Any]) -> nn.Module:
    """The module of `kind`, in eval mode (dropout off), seeded weights left to the caller."""
    if kind == "dot_product":
        module: nn.Module = DotProductAttention(dropout=0.0)
    elif kind == "additive":
        module = AdditiveAttention(hp["key_size"], hp["query_size"], hp["num_hiddens"], dropout=0.0)
    elif kind == "multi_head":
        module = MultiHeadAttention(
            hp["key_size"], hp["query_size"], hp["value_size"], hp["num_hiddens"], hp["num_heads"],
            dropout=0.0, bias=hp["bias"],
        )
    elif kind == "self_attention":
        module = SelfAttention(hp["num_hiddens"], hp["num_heads"], dropout=0.0, max_len=hp["max_len"], bias=hp["bias"])
    elif kind == "masked_softmax":
        module = MaskedSoftmax()
    elif kind == "positional_encoding":
        module = SinusoidalEncoding(max_len=hp["max_len"])
    else:
        raise ExportError(f"unknown kind {kind!r}")
    return module.eval()


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state_dict saved at `path` (`torch.save(module.state_dict(), path)`)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: it runs no code
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} not found") from e
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e.strerror or e}") from e
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph on weights_only; a class named in it means objects were pickled.
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found:
            raise CheckpointError(f"checkpoint {path} holds a {found[1]} object, not only tensors "
                                  "(torch.save(model)?), and it is loaded with weights_only: "
                                  "save model.state_dict() instead") from e
        raise CheckpointError(f"checkpoint {path} is not a file torch.save wrote") from e
    except Exception as e:  # a damaged archive, and the like
        raise CheckpointError(f"checkpoint {path} is not a readable state_dict: {str(e).splitlines()[0]}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        inner = [key for key, value in state.items() if _is_state_dict(value)] if isinstance(state, dict) else []
        hint = f": its entry {inner[0]!r} is one; save that alone" if len(inner) == 1 else ""
        raise CheckpointError(f"checkpoint {path} is not a state_dict (a mapping of names to tensors){hint}")
    return state


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


# Which weight tells each size: (parameter, axis). nn.Linear's weight is (out_features, in_features).
_SIZES_FROM: dict[str, dict[str, tuple[str, int]]] = {
    "additive": {"num_hiddens": ("W_k.weight", 0), "key_size": ("W_k.weight", 1), "query_size": ("W_q.weight", 1)},
    "multi_head": {"num_hiddens": ("W_q.weight", 0), "query_size": ("W_q.weight", 1), "key_size": ("W_k.weight", 1),
                   "value_size": ("W_v.weight", 1)},
    "self_attention": {"num_hiddens": ("W_q.weight", 0)},
}


def sizes_from_state(kind: str, state: dict[str, torch.Tensor]) -> dict[str, tuple[Any, str]]:
    """The hyperparameters a checkpoint's shapes imply, each with the evidence: {name: (value, why)}.
    What the shapes cannot tell (num_heads, max_len) is not here; a parameter that is missing or of
    the wrong rank is left to `load_checkpoint`, which names it."""
    implied: dict[str, tuple[Any, str]] = {}
    for name, (key, axis) in _SIZES_FROM.get(kind, {}).items():
        weight = state.get(key)
        if weight is not None and weight.dim() == 2:
            implied[name] = (int(weight.shape[axis]), f"{key} has shape {tuple(weight.shape)}")
    if kind in ("multi_head", "self_attention") and "W_q.weight" in state:
        implied["bias"] = ("W_q.bias" in state, "W_q.bias is " + ("there" if "W_q.bias" in state else "absent"))
    return implied


def load_checkpoint(module: nn.Module, path: Path, description: str) -> None:
    """Load a state_dict saved from the book's classes (or ours); every mismatch is named."""
    state = read_state_dict(path)
    expected = module.state_dict()
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append("missing keys: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    for key in sorted(set(expected) & set(state)):
        if tuple(state[key].shape) != tuple(expected[key].shape):
            problems.append(
                f"{key}: expected shape {tuple(expected[key].shape)}, checkpoint has {tuple(state[key].shape)}"
            )
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit {description}: " + "; ".join(problems))
    module.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})


def make_inputs(kind: str, hp: dict[str, Any], sizes: dict[str, int], seed: int) -> list[torch.Tensor]:
    """`export.repository.example_feed` as tensors, in the signature's order."""
    feed = example_feed(kind, hp, sizes, np.random.default_rng(seed))
    return [torch.from_numpy(a) for a in feed.values()]


def _name_axes(graph: Any, inputs: list, outputs: list) -> bool:
    """The graph's dynamic axes as the signature names them (torch.export may call them otherwise,
    e.g. "2*half_d" for an even d); the service checks its sessions against the signature. Whether
    any was renamed."""
    renamed = False
    for values, specs in ((graph.input, inputs), (graph.output, outputs)):
        for value, spec in zip(values, specs, strict=True):
            for dim, want in zip(value.type.tensor_type.shape.dim, spec.shape, strict=True):
                if isinstance(want, str) and dim.dim_param != want:
                    dim.dim_param = want
                    renamed = True
    return renamed


def export_onnx(module: nn.Module, kind: str, hp: dict[str, Any], path: Path) -> int:
    """Write `module` to `path` as one self-contained ONNX file; returns the opset."""
    inputs, outputs = signature(kind, hp)
    dims: dict[str, Any] = {}
    for spec in inputs:
        for name in spec.dynamic_axes.values():
            if name not in dims:
                top = hp["max_len"] if name == "n" else None
                dims[name] = torch.export.Dim(name, max=top) if top else torch.export.Dim(name)
                if kind == "positional_encoding" and name == "d":
                    # sin and cos interleave: d is even, and torch.export must be told so.
                    dims[name] = 2 * torch.export.Dim("half_d")
    dynamic_shapes = tuple({axis: dims[name] for axis, name in spec.dynamic_axes.items()} for spec in inputs)
    example = make_inputs(kind, hp, _EXAMPLE_SIZES, seed=0)
    # The exporter narrates every step on stdout and warns about things that do not concern us
    # (torchvision missing, axis renames); errors still raise.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module,
                tuple(example),
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                input_names=[s.name for s in inputs],
                output_names=[s.name for s in outputs],
                verbose=False,
            )
        except Exception as e:
            raise ExportError(f"torch.onnx.export failed for {kind}: {e}") from e
    assert program is not None
    program.save(str(path), external_data=False)
    model = onnx.load(str(path))
    if _name_axes(model.graph, inputs, outputs):
        onnx.save(model, str(path))
    return max(op.version for op in program.model_proto.opset_import if op.domain in ("", "ai.onnx"))
