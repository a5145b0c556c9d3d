"""A measured table written into the docs by the command that measured it: the text between
`<!-- NAME -->` and `<!-- /NAME -->` in a markdown file, replaced by the run's date, machine, command
and table, so that a rerun rewrites the figures and nothing else."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, no GPU used"


def write_section(path: Path, name: str, table: list[str], *, stamp: str | None = None, command: str | None = None,
                  where: str | None = None) -> None:
    """Replace the section NAME of `path` (its markers must be there: a misspelt name fails, rather
    than appending a second copy) with the run's stamp and `table`. The stamp is this run's date,
    machine and command, unless a report written later from a results file gives the run's own."""
    stamp = stamp or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = command or " ".join(["python", Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]])
    text = path.read_text()
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no section {begin} ... {end}")
    body = "\n".join([begin, f"Run {stamp} on {where or machine()}; command: `{command}`", "", *table, end])
    path.write_text(pattern.sub(lambda _: body, text, count=1))
