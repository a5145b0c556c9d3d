"""The `attend` console script (service.cli) and the `python -m` forms it stands for: help that helps and
exits 0 before anything starts, usage errors that exit 2, and the entry point pyproject.toml installs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib

import pytest

from service.cli import main
from service.config import setting_names
from tests.server import ROOT


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_help_names_the_subcommands(capsys):
    code, out, _ = _run(capsys, ["--help"])
    assert code == 0
    assert out.startswith("usage: attend") and "serve" in out and "export" in out
    words = " ".join(out.split())  # argparse wraps to the terminal's width
    assert "(python -m service)" in words and "(python -m export)" in words


@pytest.mark.parametrize("argv, message", [([], "required: COMMAND"), (["bogus"], "invalid choice: 'bogus'"),
                                           (["serve", "--port", "1"], "unrecognized arguments: --port 1"),
                                           (["export", "--kind", "nope"], "invalid choice: 'nope'")])
def test_a_usage_error_exits_2_with_the_usage(capsys, argv, message):
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert err.startswith("usage: attend") and message in err


def test_serve_help_lists_every_setting_and_how_to_listen_beyond_localhost(capsys):
    code, out, _ = _run(capsys, ["serve", "--help"])
    assert code == 0 and out.startswith("usage: attend serve")
    assert "ATTEND_HOST=0.0.0.0" in out and "ATTEND_PORT=8000" in out and "docs/settings.md" in out
    for name in setting_names():
        assert f"{name}=" in out, name
    assert "ATTEND_API_KEYS=(none)" in out  # secrets' defaults are not shown as SecretStr reprs


def test_export_help_shows_the_exporters_flags(capsys):
    code, out, _ = _run(capsys, ["export", "--help"])
    assert code == 0 and out.startswith("usage: attend export")
    for flag in ("--repository", "--kind", "--checkpoint", "--num-heads", "--max-len", "--bias"):
        assert flag in out, flag


def test_the_console_script_is_installed_by_pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    assert pyproject["project"]["scripts"] == {"attend": "service.cli:main"}
    assert "service*" in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]


def _python_m(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    # Settings that would stop a real start (an unknown variable, no repository): help comes before them.
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("ATTEND_")}
    env |= {"ATTEND_NO_SUCH_SETTING": "1", "ATTEND_MODEL_REPOSITORY": "/nonexistent"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    return result, time.monotonic() - start


@pytest.mark.parametrize("argv, usage", [(("service", "--help"), "usage: python -m service"),
                                         (("service", "-h"), "usage: python -m service"),
                                         (("service.cli", "serve", "--help"), "usage: attend serve"),
                                         (("export", "--help"), "usage: python -m export"),
                                         (("service.cli", "--help"), "usage: attend")])
def test_python_m_help_prints_and_exits_0_without_starting(argv, usage):
    result, took = _python_m(*argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage) and result.stderr == ""
    assert "ATTEND_NO_SUCH_SETTING" not in result.stdout  # nothing read the environment
    assert took < 20  # it started nothing: no models loaded, no port bound


def test_python_m_service_refuses_an_argument_with_its_usage():
    result, _ = _python_m("service", "--port", "9000")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: python -m service")
    assert "unrecognized arguments: --port 9000" in result.stderr
