"""docs/errors.md's table of every error code, written from the error classes themselves: each
`ServiceError` subclass anywhere in the service (service.core.errors' table, and those beside the code
that raises them) gives its code, its status, what it means (its docstring's first paragraph) and what
to do (its `advice`).

    python scripts/errors_table.py           write the table between <!-- errors --> and <!-- /errors -->
    python scripts/errors_table.py --check   exit 1 where docs/errors.md differs from what it would write

tests/service/test_errors_table.py runs the check, and fails on a class without a docstring or advice.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
BEGIN, END = "<!-- errors -->", "<!-- /errors -->"
# Where errors are defined: every module of these is imported, so that each subclass is found.
PACKAGES = ("service.core", "service.protocols", "service.http")


def error_classes() -> list[type]:
    """ServiceError and every subclass of it in the service, by status, code and name."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for package in PACKAGES:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, f"{package}."):
            importlib.import_module(info.name)
    from service.core.errors import ServiceError

    found, todo = [], [ServiceError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: (str(status(c)), c.code, c.__name__))


def status(cls: type) -> int | str:
    """The class's status, or how the table shows one that varies (`shown_status`: "4xx")."""
    return getattr(cls, "shown_status", cls.status)


def meaning(cls: type) -> str:
    """The first paragraph of the class's own docstring, on one line ("" where it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def advice(cls: type) -> str:
    """The class's own `advice` ("" where it only inherits one)."""
    return " ".join(str(cls.__dict__.get("advice", "")).split())


def missing(classes: list[type]) -> list[str]:
    """What each class lacks of a docstring and advice of its own."""
    return [f"{c.__module__}.{c.__name__} has no {what}" for c in classes
            for what, text in (("docstring", meaning(c)), ("advice", advice(c))) if not text]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(classes: list[type]) -> list[str]:
    rows = ["| code | status | what it means | what to do | raised as |", "| --- | --- | --- | --- | --- |"]
    for c in classes:
        rows.append(f"| `{c.code}` | {status(c)} | {_cell(meaning(c))} | {_cell(advice(c))} | "
                    f"`{c.__name__}` ({c.__module__}) |")
    return rows


def render(text: str, classes: list[type]) -> str:
    """`text` with its section between the markers replaced by the table."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no section {BEGIN} ... {END} to write the table into")
    section = "\n".join([BEGIN, "", *table(classes), "", END])
    return pattern.sub(lambda _: section, text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where the file differs from what it would be")
    parser.add_argument("--file", type=Path, default=DOC, help="the markdown file (default docs/errors.md)")
    args = parser.parse_args(argv)
    classes = error_classes()
    lacking = missing(classes)
    if lacking:
        print("\n".join(lacking), file=sys.stderr)
        return 1
    text = args.file.read_text()
    wanted = render(text, classes)
    if args.check:
        if wanted != text:
            print(f"{args.file} is stale: run python scripts/errors_table.py", file=sys.stderr)
            return 1
        return 0
    if wanted != text:
        args.file.write_text(wanted)
        print(f"wrote {len(classes)} error classes into {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
