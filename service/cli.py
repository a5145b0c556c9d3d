"""`attend`: the project's console script (pyproject.toml's [project.scripts]), one command for its two stages.

    attend serve     what `python -m service` does: serve the repository (settings: ATTEND_* variables)
    attend export    what `python -m export` does, with the same flags

Each subcommand is its package's own entry point, imported only when chosen: `attend export` needs no
web framework, `attend serve` never imports torch (the runtime image has none). The one module of
service/ that may import the exporter's entry point, inside the function that runs it
(tests/service/test_layers.py names this exception): the project's top level is fixed, and the
service's own process never reaches that import.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _serve(argv: list[str]) -> int:
    from service.__main__ import main

    return main(argv, prog="attend serve")


def _export(argv: list[str]) -> int:
    from export.cli import main

    return main(argv, prog="attend export")


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "serve the model repository over HTTP (python -m service)"),
    "export": (_export, "export the book's modules, or your checkpoint, to ONNX (python -m export)"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attend",
        description="The attention mechanisms of Dive into Deep Learning, exported to ONNX and served "
        "through ONNX Runtime.",
        epilog="`attend COMMAND --help` shows a command's own help: the settings for serve, the flags for export.",
    )
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        # The subcommand's own parser reads the rest (its --help, its flags, its errors).
        return COMMANDS[argv[0]][0](argv[1:])
    parser().parse_args(argv)  # --help exits 0; no command or an unknown one exits 2 with the usage
    return 2  # not reached: every argv that is not a command's ends in parse_args


if __name__ == "__main__":  # python -m service.cli, where the console script is not installed
    sys.exit(main())
