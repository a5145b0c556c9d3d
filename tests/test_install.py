"""The Makefile's installs, read with `make -n` (nothing is installed): the runtime-only venv gets the
project's runtime dependencies and no extra, the GPU path adds the gpu extra, and every venv gets the project
itself (its `attend` command)."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.server import ROOT


def dry_run(*args: str) -> str:
    # VENV and RUNTIME_VENV name folders that do not exist: every step is listed, whatever is installed here.
    result = subprocess.run(["make", "-n", *args, "VENV=/nonexistent/venv", "RUNTIME_VENV=/nonexistent/runtime"],
                            cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_lock_lists_the_runtime_requirements_alone():
    listed = subprocess.run([sys.executable, "scripts/lock.py", "requirements"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert listed == tomllib.load(f)["project"]["dependencies"]
    names = {re.split(r"[\[<>=]", r)[0] for r in listed}
    assert "onnxruntime-gpu" in names and not names & {"torch", "pytest", "locust", "ray", "tritonclient"}


def test_install_runtime_installs_no_extra_into_its_own_venv():
    out = dry_run("install-runtime")
    assert "/nonexistent/runtime/bin/python scripts/lock.py requirements  >/nonexistent/runtime/requirements.txt" in out
    assert "-c requirements.lock -r /nonexistent/runtime/requirements.txt" in out
    assert "/nonexistent/venv" not in out and "download.pytorch.org" not in out
    assert "scripts/lock.py requirements gpu >" in dry_run("install-runtime", "RUNTIME_EXTRAS=gpu")


def test_the_gpu_extra_joins_the_venv():
    assert "/nonexistent/venv/bin/python scripts/lock.py requirements gpu >" in dry_run("install-gpu")
    assert "scripts/lock.py requirements gpu export dev load >" in dry_run("install", "EXTRAS=gpu export dev load")


def test_install_adds_the_project_itself_after_its_locked_dependencies():
    """`make serve`'s venv has the `attend` command: the project is installed too (editable, no dependencies)."""
    out = dry_run("install")
    step = "/nonexistent/venv/bin/python -m pip install -q --no-deps -e ."
    assert step in out
    assert out.index("-r /nonexistent/venv/requirements.txt") < out.index(step)


def test_the_venv_that_runs_the_suite_has_the_attend_command():
    """`make test` installs first, so `attend` is beside the suite's Python and runs."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not run from a virtual environment (make test runs it from .venv)")
    attend = Path(sys.executable).parent / "attend"
    assert attend.exists(), f"{attend} is missing: `make install` installs the project (pip install --no-deps -e .)"
    result = subprocess.run([str(attend), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ATTEND_PORT=8000" in result.stdout
