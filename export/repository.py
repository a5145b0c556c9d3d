"""The model repository: the one contract between `export/` (writes it) and `service/` (reads it).

Torch-free on purpose: the service imports this module and must not pull torch in.

Layout::

    <repository>/<name>/config.json               what the model is and how to call it
    <repository>/<name>/<version>/model.onnx      one self-contained ONNX file, for every execution provider
    <repository>/<name>/<version>/model.cpu.onnx  dot_product, multi_head, self_attention: the same model as
                                                  ONNX's `Attention` operator (export.fused), for the CPU only
    <repository>/<name>/<version>/model.cpu.outputs.onnx  the same, without attention_weights
    <repository>/<name>/<version>/model.cuda.outputs.onnx  the same model without attention_weights as the
                                                  CUDA execution provider's fused kernels take it

config.json names each file with its sha256: `model_file` and `sha256`, and per variant
`variants[variant] = {"file", "sha256", "opset"}` (a repository written before variants has none, and
every provider runs model.onnx). The service runs `variants["cpu"]` where its sessions run on ONNX
Runtime's CPU execution provider, and model.onnx elsewhere (`ModelConfig.graph_for`); beside the CPU
graph, `variants["cpu_outputs"]` for batches that want no weights (`ModelConfig.graph_without_weights`;
versions exported before it have none, and run the CPU graph for every batch); beside model.onnx on CUDA,
`variants["cuda_outputs"]` for the same batches (versions exported before it run model.onnx for them).

Input and output names, dtypes and dynamic axes are declared once here, as data (`signature`),
and used by the exporter (dynamic shapes), the validator and the service (start-up checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CONFIG_FILE",
    "CPU_MODEL_FILE",
    "CPU_OUTPUTS_MODEL_FILE",
    "CUDA_OUTPUTS_MODEL_FILE",
    "NAME_RULE",
    "KINDS",
    "MODEL_FILE",
    "ModelConfig",
    "TensorSpec",
    "default_hyperparameters",
    "example_feed",
    "list_models",
    "list_versions",
    "model_dir",
    "read_config",
    "sha256_of",
    "signature",
    "valid_lens_2d",
    "valid_name",
    "write_config",
]

CONFIG_FILE = "config.json"
# A model's name is its folder's: the exporter writes only such names, and the service reads only such.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
MODEL_FILE = "model.onnx"
CPU_MODEL_FILE = "model.cpu.onnx"
# The CPU graph without the attention_weights output, for batches that return none (`return_weights: false`).
CPU_OUTPUTS_MODEL_FILE = "model.cpu.outputs.onnx"
# The graph a session on CUDA runs for batches that return no weights: `Attention` on a fused kernel (export.fused).
CUDA_OUTPUTS_MODEL_FILE = "model.cuda.outputs.onnx"
KINDS = ("dot_product", "additive", "multi_head", "self_attention", "masked_softmax", "positional_encoding")

# The book's configurations: the default repository and the defaults of `--kind`.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "dot_product": {},
    "additive": {"key_size": 2, "query_size": 20, "num_hiddens": 8},
    "multi_head": {
        "key_size": 100,
        "query_size": 100,
        "value_size": 100,
        "num_hiddens": 100,
        "num_heads": 5,
        "bias": False,
    },
    "self_attention": {"num_hiddens": 100, "num_heads": 5, "max_len": 1000, "bias": False},
    "masked_softmax": {},
    "positional_encoding": {"max_len": 1000},
}


def default_hyperparameters(kind: str) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    return dict(_DEFAULTS[kind])


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. `shape` holds ints for fixed axes and names for dynamic ones."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}


def signature(kind: str, hp: dict[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of the exported graph of `kind` with hyperparameters `hp`.

    Valid lengths always enter as 2-D int64 `(batch, n_q)`; callers turn 1-D and absent ones
    into that with `valid_lens_2d`. Feature sizes that no weight fixes stay dynamic.
    """
    f32, i64 = "float32", "int64"
    if kind == "dot_product":
        q_size: int | str = "d"
        k_size: int | str = "d"
        v_size: int | str = "value_size"
        out_size: int | str = "value_size"
    elif kind == "additive":
        q_size, k_size, v_size = hp["query_size"], hp["key_size"], "value_size"
        out_size = "value_size"
    elif kind == "multi_head":
        q_size, k_size, v_size = hp["query_size"], hp["key_size"], hp["value_size"]
        out_size = hp["num_hiddens"]
    elif kind == "masked_softmax":
        # The scoring function's output in, its weights out: `outputs` is the same tensor, so that
        # every model answers with the same two names.
        inputs = [
            TensorSpec("scores", f32, ("batch", "n_q", "n_k")),
            TensorSpec("valid_lens", i64, ("batch", "n_q")),
        ]
        outputs = [
            TensorSpec("outputs", f32, ("batch", "n_q", "n_k")),
            TensorSpec("attention_weights", f32, ("batch", "n_q", "n_k")),
        ]
        return inputs, outputs
    elif kind == "positional_encoding":
        # X + P for any even feature size d and n <= max_len; P itself comes back too.
        inputs = [TensorSpec("queries", f32, ("batch", "n", "d"))]
        outputs = [TensorSpec("outputs", f32, ("batch", "n", "d")), TensorSpec("P", f32, ("n", "d"))]
        return inputs, outputs
    elif kind == "self_attention":
        d = hp["num_hiddens"]
        inputs = [
            TensorSpec("queries", f32, ("batch", "n", d)),
            TensorSpec("valid_lens", i64, ("batch", "n")),
        ]
        outputs = [
            TensorSpec("outputs", f32, ("batch", "n", d)),
            TensorSpec("attention_weights", f32, ("batch", hp["num_heads"], "n", "n")),
        ]
        return inputs, outputs
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    inputs = [
        TensorSpec("queries", f32, ("batch", "n_q", q_size)),
        TensorSpec("keys", f32, ("batch", "n_k", k_size)),
        TensorSpec("values", f32, ("batch", "n_k", v_size)),
        TensorSpec("valid_lens", i64, ("batch", "n_q")),
    ]
    weights_shape: tuple[int | str, ...] = ("batch", "n_q", "n_k")
    if kind == "multi_head":
        weights_shape = ("batch", hp["num_heads"], "n_q", "n_k")
    outputs = [
        TensorSpec("outputs", f32, ("batch", "n_q", out_size)),
        TensorSpec("attention_weights", f32, weights_shape),
    ]
    return inputs, outputs


# ONNX Runtime's log severity for a session of a model.cpu.onnx: errors only. onnx's shape inference (1.23)
# of `Attention` sizes the weights' last axis 0 where n_k is symbolic; where those weights leave the graph as
# the node made them (every CPU graph since 2026-11-26; export.fused), ONNX Runtime takes the 0 for the output's
# shape and warns at every run that the real one differs (VerifyOutputSizes): a line a run, about nothing.
CPU_GRAPH_LOG_SEVERITY = 3


def shape_agrees(reported: list[int | str], declared: tuple[int | str, ...] | list[int | str]) -> bool:
    """Whether the shape ONNX Runtime reports for a graph's input or output (a session's
    `get_outputs()[i].shape`) is the one config.json declares, axis for axis: the same size, the same name,
    or 0 where config.json names the axis (what onnx's shape inference of `Attention` makes of a symbolic
    size, CPU_GRAPH_LOG_SEVERITY)."""
    return len(reported) == len(declared) and all(
        r == d or (r == 0 and isinstance(d, str)) for r, d in zip(reported, declared, strict=True))


def one_head_axis(reported: list[int | str], declared: tuple[int | str, ...] | list[int | str]) -> bool:
    """Whether a graph's output shape `reported` is the one config.json declares with an axis of size 1
    after the first: the weights of a one-head `Attention` node, (batch, 1, n_q, n_k), which dot_product's
    CPU graph leaves as the node makes them (export.fused: a Reshape at a graph's output copies them).
    Whoever runs that graph views them without the axis (`without_head_axis`)."""
    return len(reported) == len(declared) + 1 and reported[1] == 1 and \
        shape_agrees([reported[0], *reported[2:]], declared)


def without_head_axis(array: np.ndarray) -> np.ndarray:
    """`array` without its second axis, of size 1 (`one_head_axis`): a view, nothing copied."""
    return array.reshape(array.shape[:1] + array.shape[2:])


def valid_lens_2d(valid_lens: Any, batch: int, n_q: int, n_k: int) -> np.ndarray:
    """The graph's `(batch, n_q)` int64 valid lengths from None, `(batch,)` or `(batch, n_q)`.

    None means every key (n_k); a 1-D length applies to every query of its example.
    """
    if valid_lens is None:
        return np.full((batch, n_q), n_k, dtype=np.int64)
    lens = np.asarray(valid_lens, dtype=np.int64)
    if lens.shape == (batch,):
        return np.ascontiguousarray(np.broadcast_to(lens[:, None], (batch, n_q)))
    if lens.shape == (batch, n_q):
        return np.ascontiguousarray(lens)
    raise ValueError(f"valid_lens must be (batch,) = ({batch},) or (batch, n_q) = ({batch}, {n_q}), got {lens.shape}")


def example_feed(kind: str, hp: dict[str, Any], sizes: dict[str, int],
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 inputs of `kind`'s signature, the named axes sized from `sizes`, valid
    lengths full (every key). For the exporter's example, its validation sweep and the service's
    warm-up alike."""
    inputs, _ = signature(kind, hp)
    feed: dict[str, np.ndarray] = {}
    for spec in inputs:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
        if spec.dtype == "int64":
            key_axis = "n" if spec.shape[1] == "n" else "n_k"  # self_attention: keys are the queries
            feed[spec.name] = valid_lens_2d(None, shape[0], shape[1], sizes[key_axis])
        else:
            feed[spec.name] = rng.standard_normal(shape, dtype=np.float32)
    return feed


@dataclass
class ModelConfig:
    """`<name>/config.json`."""

    name: str
    kind: str
    version: int
    hyperparameters: dict[str, Any]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    dynamic_axes: dict[str, dict[str, str]]
    opset: int
    sha256: str
    versions: dict[str, str] = field(default_factory=dict)  # torch, onnx, ... that made it
    model_file: str = ""
    # Graphs of the same model for one execution provider: {"cpu": {"file", "sha256", "opset"}}, and
    # "cpu_outputs", the CPU graph without attention_weights; "cuda_outputs", CUDA's graph without them.
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def build(cls, name: str, kind: str, version: int, hp: dict[str, Any], opset: int,
              sha256: str, versions: dict[str, str],
              variants: dict[str, dict[str, Any]] | None = None) -> ModelConfig:
        inputs, outputs = signature(kind, hp)
        specs = inputs + outputs
        return cls(
            name=name,
            kind=kind,
            version=version,
            hyperparameters=hp,
            inputs=[_spec_dict(s) for s in inputs],
            outputs=[_spec_dict(s) for s in outputs],
            dynamic_axes={s.name: {str(i): d for i, d in s.dynamic_axes.items()} for s in specs},
            opset=opset,
            sha256=sha256,
            versions=versions,
            model_file=f"{version}/{MODEL_FILE}",
            variants=variants or {},
        )

    def graph_for(self, cpu: bool) -> tuple[str, str, int]:
        """(file, sha256, opset) of the graph to run: the CPU variant where the session runs on the CPU
        execution provider and there is one, else model.onnx."""
        variant = self._variant("cpu") if cpu else None
        return (self.model_file, self.sha256, self.opset) if variant is None else variant

    def graph_without_weights(self, cpu: bool = True) -> tuple[str, str, int] | None:
        """(file, sha256, opset) of the graph without attention_weights for the CPU execution provider (or,
        with `cpu` False, for CUDA), where there is one."""
        return self._variant("cpu_outputs" if cpu else "cuda_outputs")

    def _variant(self, name: str) -> tuple[str, str, int] | None:
        variant = self.variants.get(name)
        if variant is None:
            return None
        if not (isinstance(variant, dict) and isinstance(variant.get("file"), str)
                and isinstance(variant.get("sha256"), str) and isinstance(variant.get("opset"), int)):
            raise ValueError(f'variants["{name}"] must be {{"file": str, "sha256": str, "opset": int}}')
        return variant["file"], variant["sha256"], variant["opset"]

    def input_specs(self) -> list[TensorSpec]:
        return [TensorSpec(d["name"], d["dtype"], tuple(d["shape"])) for d in self.inputs]

    def output_specs(self) -> list[TensorSpec]:
        return [TensorSpec(d["name"], d["dtype"], tuple(d["shape"])) for d in self.outputs]


def _spec_dict(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_config(model_dir: Path, version: int | None = None) -> ModelConfig:
    """The model's config.json (its newest version), or one version's own (`<version>/config.json`;
    for a version exported before versions had one, the model's, if it is that version)."""
    path = model_dir / CONFIG_FILE
    if version is not None and (model_dir / str(version) / CONFIG_FILE).exists():
        path = model_dir / str(version) / CONFIG_FILE
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    config = ModelConfig(**raw)
    if version is not None and config.version != version:
        raise FileNotFoundError(f"{model_dir.name}/{version} has no config.json")
    return config


def list_versions(model_dir: Path) -> list[int]:
    """The version folders of a model, oldest first."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def write_config(model_dir: Path, config: ModelConfig) -> None:
    """Atomically (write to a temporary file, then rename) so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=model_dir, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(config), f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a service running as another user reads it
        os.replace(tmp, model_dir / CONFIG_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def list_models(repository: Path) -> list[Path]:
    """Model folders of a repository (hidden folders are exports in progress). A folder with a model's name
    whose config.json cannot be looked at (permissions) is listed, so that its load says why; OSError when
    the repository itself cannot be listed."""
    return sorted(p for p in repository.iterdir() if not p.name.startswith(".") and p.is_dir() and _holds_config(p))


def _holds_config(folder: Path) -> bool:
    try:
        return (folder / CONFIG_FILE).exists()
    except OSError:  # e.g. owned by another user, mode 0700; lost+found, at a volume's root, is no model's name
        return valid_name(folder.name)


def valid_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def model_dir(repository: Path, name: str) -> Path | None:
    """`<repository>/<name>`, for a valid name whose folder (symbolic links resolved) is inside the
    repository; else None."""
    if not valid_name(name):
        return None
    path = repository / name
    try:
        root = repository.resolve()
        return path if path.resolve().is_relative_to(root) and path.resolve() != root else None
    except OSError:
        return None
