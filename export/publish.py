"""Export one model into the repository: build, (load checkpoint), export, validate, publish.

Each version folder holds its model.onnx (the traced graph, for every execution provider), for
dot_product, multi_head and self_attention also model.cpu.onnx (export.fused: ONNX's `Attention`,
for the CPU execution provider), model.cpu.outputs.onnx (the same without attention_weights, for
batches that return none) and model.cuda.outputs.onnx (CUDA's graph for those batches), and its own
config.json; the model's config.json (the same as its newest version's) says which version is the newest.

Nothing is half-written: the graph is exported and validated in a hidden folder inside the
repository and renamed into place only when every check passed; config.json is replaced
atomically last, so the service only ever sees a complete, validated version.

Exporters of one repository may run at once: each picks its version number and publishes it with the
repository locked (flock), and removes the hidden folders of exports that ended without removing theirs
(SIGKILL, out of memory): each exporter holds a lock on its own for as long as it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch

from export.build import build_module, export_onnx, load_checkpoint
from export.errors import ExportError
from export.fused import FUSED_KINDS, export_fused
from export.repository import (
    CONFIG_FILE,
    CPU_MODEL_FILE,
    CPU_OUTPUTS_MODEL_FILE,
    CUDA_OUTPUTS_MODEL_FILE,
    MODEL_FILE,
    NAME_RULE,
    ModelConfig,
    sha256_of,
    valid_name,
    write_config,
)
from export.validate import validate

__all__ = ["export_model"]

def _describe(kind: str, hp: dict[str, Any]) -> str:
    return f"{kind}(" + ", ".join(f"{k}={v}" for k, v in hp.items()) + ")"


def _next_version(model_dir: Path) -> int:
    if not model_dir.exists():
        return 1
    versions = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(versions, default=0) + 1


@contextlib.contextmanager
def _locked(folder: Path, wait: bool = True) -> Iterator[bool]:
    """`folder` locked (flock, on the folder itself) while inside; without `wait`, False where another holds it
    (or where the file system has no locks: then nothing is known of its exporter)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
        except OSError:  # a file system without locks (NFS refuses flock on a folder): as before there were any
            yield wait
        else:
            yield True
    finally:
        os.close(fd)  # and the lock with it


_STAGED = frozenset({MODEL_FILE, CPU_MODEL_FILE, CPU_OUTPUTS_MODEL_FILE, CUDA_OUTPUTS_MODEL_FILE, CONFIG_FILE})


def _is_staging(folder: Path) -> bool:
    """An export's hidden folder (mkdtemp's `.<name>.<8 characters>`, holding only what an export writes), not
    someone else's."""
    name, _, suffix = folder.name[1:].rpartition(".")
    if not (valid_name(name) and re.fullmatch(r"[a-z0-9_]{8}", suffix) and folder.is_dir()):
        return False
    try:
        return all(entry.name in _STAGED for entry in folder.iterdir())
    except OSError:
        return False


def _stage(repository: Path, name: str, stack: contextlib.ExitStack) -> Path:
    """A hidden folder for the export, locked for as long as `stack` is open; first, the folders of exporters
    that ended without removing theirs (SIGKILL, out of memory: their lock went with them) are removed."""
    with _locked(repository):
        for folder in filter(_is_staging, repository.glob(".*.*")):
            with contextlib.suppress(OSError), _locked(folder, wait=False) as abandoned:
                if abandoned:
                    shutil.rmtree(folder)
        staging = Path(tempfile.mkdtemp(dir=repository, prefix=f".{name}."))
        stack.enter_context(_locked(staging))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; it becomes the version folder the service reads
    return staging


def export_model(repository: Path, name: str, kind: str, hp: dict[str, Any],
                 checkpoint: Path | None = None, seed: int = 0) -> ModelConfig:
    """Publish `<repository>/<name>/<version>/model.onnx` (and the fused graphs) and `config.json`;
    return the config. Every graph passes the same validation against the module before anything is published.

    Without a checkpoint the weights are seeded (`seed`), as for the default repository.
    """
    if not valid_name(name):
        raise ExportError(f"model name {name!r} must be {NAME_RULE}")
    torch.manual_seed(seed)
    try:
        module = build_module(kind, hp)
    except ValueError as e:
        raise ExportError(f"invalid hyperparameters for {kind}: {e}") from e
    if checkpoint is not None:
        load_checkpoint(module, checkpoint, _describe(kind, hp))

    for folder in (repository, repository / name):  # said before the seconds of export and validation
        if folder.exists() and not folder.is_dir():
            raise ExportError(f"{folder} is a file, not a folder")
    repository.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        staging = _stage(repository, name, stack)
        stack.callback(shutil.rmtree, staging, ignore_errors=True)  # once published, nothing is left to remove
        model_path = staging / MODEL_FILE
        opset = export_onnx(module, kind, hp, model_path)
        validate(module, kind, hp, model_path)
        cpu_path, outputs_path = staging / CPU_MODEL_FILE, staging / CPU_OUTPUTS_MODEL_FILE
        cuda_path = staging / CUDA_OUTPUTS_MODEL_FILE
        cpu_opset = export_fused(module, kind, hp, cpu_path) if kind in FUSED_KINDS else None
        if cpu_opset is not None:
            validate(module, kind, hp, cpu_path)
            export_fused(module, kind, hp, outputs_path, weights=False)
            validate(module, kind, hp, outputs_path, weights=False)
            export_fused(module, kind, hp, cuda_path, weights=False, cuda=True)
            validate(module, kind, hp, cuda_path, weights=False)  # on the CPU execution provider: it runs there
        with _locked(repository):
            return _publish(repository, name, kind, hp, opset, cpu_opset, staging)


def _publish(repository: Path, name: str, kind: str, hp: dict[str, Any], opset: int, cpu_opset: int | None,
             staging: Path) -> ModelConfig:
    """The next version of `name`, from the validated graphs in `staging` (under the repository's lock)."""
    model_path, cpu_path = staging / MODEL_FILE, staging / CPU_MODEL_FILE
    outputs_path, cuda_path = staging / CPU_OUTPUTS_MODEL_FILE, staging / CUDA_OUTPUTS_MODEL_FILE
    model_dir = repository / name
    model_dir.mkdir(exist_ok=True)
    version = _next_version(model_dir)
    variants = {} if cpu_opset is None else {
        "cpu": {"file": f"{version}/{CPU_MODEL_FILE}", "sha256": sha256_of(cpu_path), "opset": cpu_opset},
        "cpu_outputs": {"file": f"{version}/{CPU_OUTPUTS_MODEL_FILE}", "sha256": sha256_of(outputs_path),
                        "opset": cpu_opset},
        "cuda_outputs": {"file": f"{version}/{CUDA_OUTPUTS_MODEL_FILE}", "sha256": sha256_of(cuda_path),
                         "opset": cpu_opset}}
    config = ModelConfig.build(
        name=name, kind=kind, version=version, hp=hp, opset=opset, sha256=sha256_of(model_path),
        versions={"torch": torch.__version__, "onnx": onnx.__version__}, variants=variants,
    )
    write_config(staging, config)  # the version's own description, for a service that loads it later
    staging.rename(model_dir / str(version))
    write_config(model_dir, config)  # the model's newest version
    return config
