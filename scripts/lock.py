"""The dependency lock (`requirements.lock`) and what installs from it. Standard library only: it runs
before any virtual environment exists.

    python scripts/lock.py requirements EXTRA...   the project's requirements plus those extras', one a line
    python scripts/lock.py check                   exit 1 when pyproject.toml's dependencies changed since
                                                   the lock was made (run `make lock`)
    python scripts/lock.py stamp                   record pyproject.toml's dependencies in the lock (make lock)

`requirements.lock` is pip-compile's resolution of every dependency of every extra, to exact versions.
Installs use it as a constraints file (`pip install -c requirements.lock -r <requirements of the extras
needed>`), so each place installs only what it needs (the CPU venv no CUDA wheels, the runtime image no
torch), and always at the locked versions.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements.lock"
_STAMP = "# pyproject.toml dependencies sha256: "


def _project() -> dict:
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]


def requirements(extras: list[str]) -> list[str]:
    project = _project()
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(sorted(optional))}")
    return list(project["dependencies"]) + [r for extra in extras for r in optional[extra]]


def digest() -> str:
    """What the lock was resolved from: the requirements of the project and of every extra."""
    project = _project()
    inputs = {"requires-python": project.get("requires-python"), "dependencies": project["dependencies"],
              "optional-dependencies": project.get("optional-dependencies", {})}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def stamp() -> None:
    lines = [line for line in LOCK.read_text().splitlines() if not line.startswith(_STAMP)]
    LOCK.write_text("\n".join([_STAMP + digest(), *lines]) + "\n")


def check() -> int:
    if not LOCK.exists():
        print(f"{LOCK.name} is missing: run `make lock` and commit it", file=sys.stderr)
        return 1
    recorded = next((line[len(_STAMP):].strip() for line in LOCK.read_text().splitlines()
                     if line.startswith(_STAMP)), None)
    if recorded != digest():
        print(f"pyproject.toml's dependencies changed since {LOCK.name} was made: run `make lock` and commit "
              f"{LOCK.name} with pyproject.toml", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"]:
        print("\n".join(requirements(argv[1:])))
        return 0
    if argv == ["check"]:
        return check()
    if argv == ["stamp"]:
        stamp()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
