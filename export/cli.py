"""`python -m export`: the default repository, or one model of your own.

    python -m export                                                # the book's configurations
    python -m export --kind additive --name mine --checkpoint additive.pt
    python -m export --kind multi_head --name mha --checkpoint mha.pt --num-heads 5

With a checkpoint, the sizes come from its parameter shapes; what shapes cannot tell is asked for by
name (--num-heads), or taken as the book made it and said in one line (--max-len: the book's
PositionalEncoding keeps max_len=1000), and a flag that contradicts the checkpoint is an error naming
the value the checkpoint implies.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
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
    "masked_softmax": (),
    "positional_encoding": ("max_len",),
}
_ALL_FLAGS = ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "max_len", "bias")


def _parser(prog: str = "python -m export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Export attention modules to a validated ONNX model repository. "
        "Without --kind: the default repository (dot_product, additive, multi_head, self_attention, "
        "masked_softmax, positional_encoding).",
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


# What a checkpoint's shapes cannot tell, per kind: asked for by name when a checkpoint is given, unless
# the book's class has a default for it (_BOOK_DEFAULTS).
_NOT_IN_SHAPES: dict[str, tuple[str, ...]] = {
    "multi_head": ("num_heads",),
    "self_attention": ("num_heads", "max_len"),
    "positional_encoding": ("max_len",),
}
# The book's defaults for what a checkpoint cannot tell: the book's PositionalEncoding keeps P as a plain
# tensor, not in the state_dict, and its max_len defaults to 1000 (MultiHeadAttention's checkpoint of
# self_attention has no positional encoding at all). Used, and said in one line, when the flag is not given.
_BOOK_DEFAULTS: dict[str, tuple[int, str]] = {
    "max_len": (1000, "the book's default (PositionalEncoding(num_hiddens, dropout, max_len=1000))"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def hyperparameters(kind: str, args: argparse.Namespace,
                    implied: dict[str, tuple[Any, str]] | None = None) -> dict[str, Any]:
    """The kind's hyperparameters: from the checkpoint's shapes (`implied`, with the evidence) where
    one is given, else the book's defaults; overridden by the flags given, which must agree with the
    checkpoint. A flag that the kind does not take is an error."""
    given = {f: getattr(args, f) for f in _ALL_FLAGS if getattr(args, f) is not None}
    foreign = sorted(set(given) - set(_FLAGS[kind]))
    if foreign:
        flags = ", ".join(_flag(f) for f in foreign)
        raise ExportError(f"{flags} do(es) not apply to kind {kind}; it takes: "
                          + (", ".join(_flag(f) for f in _FLAGS[kind]) or "none"))
    hp = default_hyperparameters(kind)
    if implied is not None:
        for name, value in given.items():
            if name in implied and implied[name][0] != value:
                shown = value if name != "bias" else "(given)"
                raise ExportError(f"{_flag(name)} {shown} contradicts the checkpoint: {implied[name][1]}, so "
                                  f"{name} is {implied[name][0]}; leave the flag out or fix it")
        untold = [name for name in _NOT_IN_SHAPES.get(kind, ()) if name not in given]
        needed = [name for name in untold if name not in _BOOK_DEFAULTS]
        if needed:
            hidden = implied.get("num_hiddens", (None, ""))[0]
            why = f" (num_hiddens = {hidden})" if hidden else ""
            raise ExportError(" and ".join(_flag(n) for n in needed) + f" needed: a checkpoint's shapes do not tell "
                              f"{' or '.join(needed)}{why}; e.g. " + " ".join(f"{_flag(n)} N" for n in needed))
        for name in untold:  # only the book's defaults are left
            value, why = _BOOK_DEFAULTS[name]
            hp[name] = value
            print(f"{name}: {value}, {why}; {_flag(name)} overrides")
        hp.update({name: value for name, (value, _) in implied.items()})
    elif kind == "multi_head" and "num_hiddens" in given:
        # The book's multi-head examples use key = query = value size = num_hiddens.
        for size in ("key_size", "query_size", "value_size"):
            hp[size] = given["num_hiddens"]
    hp.update(given)
    for key, value in hp.items():
        if key != "bias" and value <= 0:
            raise ExportError(f"{_flag(key)} must be positive, got {value}")
    return hp


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM (`timeout`, `docker stop`, a Job's deadline) ends an export as Ctrl-C does, its hidden folder
    removed on the way out (SIGTERM's default action skips that): exit code 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None, prog: str = "python -m export") -> int:
    args = _parser(prog).parse_args(argv)
    # Import late: --help stays fast and torch-free.
    from export.publish import export_model

    with _sigterm_exits():
        try:
            if args.kind is None:
                if args.name or args.checkpoint or any(getattr(args, f) is not None for f in _ALL_FLAGS):
                    raise ExportError("--name, --checkpoint and size flags need --kind")
                jobs = [(kind, kind, default_hyperparameters(kind), None) for kind in KINDS]
            else:
                implied = None
                if args.checkpoint is not None:
                    from export.build import read_state_dict, sizes_from_state

                    implied = sizes_from_state(args.kind, read_state_dict(args.checkpoint))
                jobs = [(args.name or args.kind, args.kind, hyperparameters(args.kind, args, implied), args.checkpoint)]
            for name, kind, hp, checkpoint in jobs:
                start = time.perf_counter()
                config = export_model(args.repository, name, kind, hp, checkpoint=checkpoint, seed=args.seed)
                print(f"exported {name} ({kind}) version {config.version} -> "
                      f"{args.repository / name / config.model_file}, validated in {time.perf_counter() - start:.1f}s")
        except ExportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:  # the repository: a full disk, a read-only mount, a path through a file
            print(f"error: cannot write to the repository {args.repository}: {e.strerror or e}", file=sys.stderr)
            return 1
        return 0
