"""Settings that arrive, or a start that says why not: an ATTEND_* variable that names no setting stops
the service with one line naming it and the setting it most likely meant (a typo would otherwise serve
with the setting unset: ATTEND_API_KEY=... with no key at all), and docker compose passes every setting
on (tests/container/lint.sh checks the same with the real compose binary)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from service.config import TOOL_VARIABLES, UnknownSetting, check_environment, setting_names
from tests.server import ROOT


def _start(repository, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("ATTEND_")}
    environ |= {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cpu", "ATTEND_PORT": "0"} | env
    return subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("name, meant", [("ATTEND_API_KEY", "ATTEND_API_KEYS"),
                                         ("ATTEND_MAX_INFLIGHT", "ATTEND_MAX_INFLIGHT_BYTES"),
                                         ("attend_max_queu", "ATTEND_MAX_QUEUE")])
def test_an_unknown_setting_stops_the_start_with_one_line(repository, name, meant):
    result = _start(repository, **{name: "secret"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0] == (f"cannot start: unknown setting {name} (did you mean {meant}?): every ATTEND_* variable "
                        "must be one of the settings docs/settings.md lists")


def test_a_setting_of_the_wrong_type_stops_the_start_with_one_line(repository):
    result = _start(repository, ATTEND_MAX_QUEUE="many")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("cannot start: ATTEND_MAX_QUEUE: Input should be a valid integer")
    assert "'many'" in lines[0]


def test_the_tools_variables_and_every_setting_pass():
    check_environment(dict.fromkeys([*setting_names(), *TOOL_VARIABLES], "1"))
    with pytest.raises(UnknownSetting, match="ATTEND_NOPE"):
        check_environment({"ATTEND_NOPE": "1", "PATH": "/bin"})


def test_compose_passes_every_setting_on():
    """Each setting is in the api service's environment: fixed, defaulted, or a bare name (the caller's
    value, or none)."""
    with open(ROOT / "docker-compose.yml") as f:
        api = yaml.safe_load(f)["services"]["api"]
    assert set(api["environment"]) == set(setting_names())
