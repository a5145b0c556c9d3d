"""`python -m export`: the default repository, or one model of your own.

    python -m export                                  # the book's four configurations
    python -m export --kind additive --name mine --checkpoint additive.pt \
        --key-size 2 --query-size 20 --num-hiddens 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from export.errors import ExportError
from export.repository import KINDS, default_hyperparameters

# Which flags each kind takes (the others have no meaning for it and are refused).
_FLAGS: dict[str, tuple[str, ...]] = {
    "dot_product": (),
    "additive": ("key_size", "query_size", "num_hiddens"),
    "multi_head": ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "bias"),
    "self_attention": ("num_hiddens", "num_heads", "max_len", "bias"),
}
_ALL_FLAGS = ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "max_len", "bias")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export",
        description="Export attention modules to a validated ONNX model repository. "
        "Without --kind: the default repository (dot_product, additive, multi_head, self_attention).",
    )
    p.add_argument("--repository", type=Path, default=Path("model_repository"),
                   help="target folder (default: %(default)s)")
    p.add_argument("--kind", choices=KINDS, help="export one model of this kind")
    p.add_argument("--name", help="its name in the repository (default: the kind)")
    p.add_argument("--checkpoint", type=Path, help="a state_dict (.pt) saved from the book's class or ours")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights when there is no checkpoint")
    for flag in ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "max_len"):
        p.add_argument("--" + flag.replace("_", "-"), type=int, dest=flag, metavar="N")
    p.add_argument("--bias", action="store_true", default=None, help="multi_head/self_attention: linear maps with bias")
    return p


def hyperparameters(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """The kind's book defaults, overridden by the flags given; a flag that the kind does not
    take is an error."""
    given = {f: getattr(args, f) for f in _ALL_FLAGS if getattr(args, f) is not None}
    foreign = sorted(set(given) - set(_FLAGS[kind]))
    if foreign:
        flags = ", ".join("--" + f.replace("_", "-") for f in foreign)
        raise ExportError(f"{flags} do(es) not apply to kind {kind}; it takes: "
                          + (", ".join("--" + f.replace("_", "-") for f in _FLAGS[kind]) or "none"))
    hp = default_hyperparameters(kind)
    if kind == "multi_head" and "num_hiddens" in given:
        # The book's multi-head examples use key = query = value size = num_hiddens.
        for size in ("key_size", "query_size", "value_size"):
            hp[size] = given["num_hiddens"]
    hp.update(given)
    for key, value in hp.items():
        if key != "bias" and value <= 0:
            raise ExportError(f"--{key.replace('_', '-')} must be positive, got {value}")
    return hp


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Import late: --help stays fast and torch-free.
    from export.publish import export_model

    try:
        if args.kind is None:
            if args.name or args.checkpoint or any(getattr(args, f) is not None for f in _ALL_FLAGS):
                raise ExportError("--name, --checkpoint and size flags need --kind")
            jobs = [(kind, kind, default_hyperparameters(kind), None) for kind in KINDS]
        else:
            jobs = [(args.name or args.kind, args.kind, hyperparameters(args.kind, args), args.checkpoint)]
        for name, kind, hp, checkpoint in jobs:
            start = time.perf_counter()
            config = export_model(args.repository, name, kind, hp, checkpoint=checkpoint, seed=args.seed)
            print(f"exported {name} ({kind}) version {config.version} -> "
                  f"{args.repository / name / config.model_file}, validated in {time.perf_counter() - start:.1f}s")
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
