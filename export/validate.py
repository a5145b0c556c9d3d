"""Validate an exported graph before it is published: onnx.checker, then ONNX Runtime (CPU)
against the PyTorch module on a sweep of shapes and valid lengths (CUDA's graph without the weights
too: ONNX Runtime's CPU kernels run it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from export.build import make_inputs
from export.errors import ValidationError
from export.repository import (
    CPU_GRAPH_LOG_SEVERITY,
    MODEL_FILE,
    one_head_axis,
    signature,
    valid_lens_2d,
    without_head_axis,
)

__all__ = ["Case", "TOLERANCE", "sweep", "validate"]

TOLERANCE = 1e-5  # absolute and relative, on outputs and weights


@dataclass(frozen=True)
class Case:
    """One point of the sweep. `lens` is 'none', '1d' or '2d'; the sizes of axes that the
    model fixes are ignored."""

    batch: int
    n_q: int
    n_k: int
    lens: str
    d: int = 7
    value_size: int = 9

    def __str__(self) -> str:
        return (f"batch={self.batch} n_q={self.n_q} n_k={self.n_k} d={self.d} value_size={self.value_size} "
                f"valid_lens={self.lens}")


def sweep(kind: str, hp: dict[str, Any]) -> list[Case]:
    """Batch 1 and several; n_q != n_k != batch; absent, 1-D and 2-D lengths (0 and full among
    them); feature sizes other than the export example's."""
    cases = [
        Case(1, 1, 1, "none"),
        Case(1, 4, 6, "1d"),
        Case(2, 3, 5, "2d"),
        Case(3, 5, 7, "2d", d=3, value_size=13),
        Case(4, 2, 9, "1d", d=16, value_size=1),
        Case(5, 7, 3, "none", d=2, value_size=4),
        Case(6, 1, 11, "2d"),
        Case(2, 8, 1, "1d"),
    ]
    if kind == "self_attention":
        # One sequence axis: n_q == n_k; also the longest sequence the model accepts.
        cases = [Case(c.batch, c.n_q, c.n_q, c.lens) for c in cases]
        cases += [Case(2, 9, 9, "2d"), Case(1, hp["max_len"], hp["max_len"], "1d")]
    if kind == "positional_encoding":
        # One sequence axis, no lengths, an even d (odd ones included above become even); the longest
        # sequence, and the chapter's figure (60 positions x 32 dimensions).
        cases = [Case(c.batch, c.n_q, c.n_q, "none", d=c.d + c.d % 2) for c in cases]
        cases += [Case(1, 60, 60, "none", d=32), Case(2, hp["max_len"], hp["max_len"], "none", d=100)]
    return cases


def _valid_lens(case: Case, n_k: int, rng: np.random.Generator) -> np.ndarray | None:
    """Random lengths in [0, n_k + 1]: 0 (attend to nothing), n_k (all) and above it included."""
    if case.lens == "none":
        return None
    shape = (case.batch,) if case.lens == "1d" else (case.batch, case.n_q)
    lens = rng.integers(0, n_k + 2, size=shape)
    flat = lens.reshape(-1)
    flat[0] = 0
    if flat.size > 1:
        flat[-1] = n_k
    return lens


def _close(actual: np.ndarray, expected: np.ndarray, tolerance: float = TOLERANCE) -> tuple[bool, float]:
    if actual.shape != expected.shape:
        return False, float("inf")
    err = np.abs(actual - expected)
    ok = bool(np.all(err <= tolerance + tolerance * np.abs(expected)))
    return ok, float(err.max()) if err.size else 0.0


def run_case(module: nn.Module, session: ort.InferenceSession, kind: str, hp: dict[str, Any], case: Case,
             seed: int = 0, weights: bool = True, tolerance: float = TOLERANCE) -> None:
    """Raise ValidationError when ONNX Runtime and PyTorch disagree on `case` by more than `tolerance` (on
    the outputs but attention_weights, where `weights` is False: a graph without them)."""
    inputs, outputs = signature(kind, hp)
    sizes = {"batch": case.batch, "n_q": case.n_q, "n_k": case.n_k, "n": case.n_q, "d": case.d,
             "value_size": case.value_size}
    tensors = make_inputs(kind, hp, sizes, seed)
    has_lens = inputs[-1].name == "valid_lens"  # it comes last where a signature has it
    floats = tensors[:-1] if has_lens else tensors
    lens = _valid_lens(case, case.n_k, np.random.default_rng(seed)) if has_lens else None
    with torch.no_grad():
        expected = module(*floats, None if lens is None else torch.from_numpy(lens)) if has_lens else module(*floats)
    feed = {spec.name: t.numpy() for spec, t in zip(inputs, floats, strict=False)}
    if has_lens:
        feed["valid_lens"] = valid_lens_2d(lens, case.batch, case.n_q, case.n_k)
    if not weights:
        expected = [want for spec, want in zip(outputs, expected, strict=True) if spec.name != "attention_weights"]
        outputs = [spec for spec in outputs if spec.name != "attention_weights"]
    try:
        actual = session.run([s.name for s in outputs], feed)
    except Exception as e:
        raise ValidationError(f"ONNX Runtime failed on case {case}: {e}") from e
    for spec, got, want in zip(outputs, actual, expected, strict=True):
        if one_head_axis(list(got.shape), tuple(want.shape)):  # dot_product's CPU graph's weights
            got = without_head_axis(got)
        ok, err = _close(got, want.numpy(), tolerance)
        if not ok:
            raise ValidationError(
                f"{spec.name} differs from PyTorch on case {case}: shape {got.shape} vs {tuple(want.shape)}, "
                f"max abs error {err:.3g} (tolerance {tolerance})"
            )


def validate(module: nn.Module, kind: str, hp: dict[str, Any], path: Path, weights: bool = True,
             tolerance: float = TOLERANCE) -> int:
    """onnx.checker, then the sweep (without attention_weights where `weights` is False) to `tolerance`;
    returns the number of cases that passed."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise ValidationError(f"onnx.checker rejected {path}: {e}") from e
    options = ort.SessionOptions()
    if path.name != MODEL_FILE:  # the fused graphs: onnx sizes an axis 0 (export.fused)
        options.log_severity_level = CPU_GRAPH_LOG_SEVERITY
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    cases = sweep(kind, hp)
    for i, case in enumerate(cases):
        run_case(module, session, kind, hp, case, seed=i, weights=weights, tolerance=tolerance)
    return len(cases)
