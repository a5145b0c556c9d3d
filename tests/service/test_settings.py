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
from tests.server import ROOT, limited_cgroup


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


def _cgroups(tmp_path, own: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self").write_text(own)
    return root, tmp_path / "self"


@pytest.mark.parametrize("own, files, quota", [
    # v2: the process's cgroup and those above it; the least counts.
    ("0::/pod/app\n", {"pod/cpu.max": "150000 100000\n", "pod/app/cpu.max": "max 100000\n"}, 1.5),
    ("0::/pod/app\n", {"pod/cpu.max": "max 100000\n", "pod/app/cpu.max": "50000 100000\n"}, 0.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v2 in a container's namespace: its own cgroup at the mount.
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
    # v1, the host's path of a container whose cgroup is mounted as the controller's root.
    ("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n",
     {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/a\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
                    "cpu/a/cpu.cfs_quota_us": "25000\n", "cpu/a/cpu.cfs_period_us": "100000\n"}, 0.25),
    ("1:cpu:/a\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("garbage\n", {}, None),
])
def test_a_cpu_quota_is_read_from_either_cgroup_version(tmp_path, own, files, quota):
    from service.config import cpu_quota

    assert cpu_quota(*_cgroups(tmp_path, own, files)) == quota


def _quota_cgroup(v2: tuple[str, str] = ("cpu.max", "50000 100000"), v1: tuple[str, str, str] = (
        "cpu", "cpu.cfs_quota_us", "50000")) -> str | None:
    """tests.server.limited_cgroup, by default of half a CPU."""
    return limited_cgroup(v2, v1)


def test_a_cpu_quota_sets_the_threads_as_cores_would():
    """Before, a container of half a CPU on a 2-core host ran 2 threads a session and 2 inference threads: on
    W2-like bodies half the requests/s of one thread, and p99 1.8x (docs/benchmarks.md, "A CPU quota")."""
    folder = _quota_cgroup()
    if folder is None:
        pytest.skip("a CPU quota is set in a cgroup of the test's own, which needs root and a writable cgroup "
                    "filesystem: the project's machines have both")
    code = ("from service.config import Settings, usable_cores; s = Settings(); "
            "print(usable_cores(), s.resolved_intra_op_threads(), s.resolved_inference_threads())")
    try:
        inside = subprocess.run(["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "quota",
                                 sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        os.rmdir(folder)
    assert inside.stdout == "1 1 1\n", inside.stderr


@pytest.mark.parametrize("own, files, limit", [
    ("0::/pod/app\n", {"pod/memory.max": "629145600\n", "pod/app/memory.max": "max\n"}, 629145600),
    ("0::/\n", {"memory.max": "max\n"}, None),
    ("5:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "536870912\n"}, 536870912),
    ("5:memory:/a\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
])
def test_a_memory_limit_is_read_from_either_cgroup_version(tmp_path, own, files, limit):
    from service.config import memory_limit

    assert memory_limit(*_cgroups(tmp_path, own, files)) == limit


_SHORT = ("WARNING service [-] the memory limit (600 MiB, the cgroup's) is less than ATTEND_WORKERS=1 x ({idle} MiB "
          "+ 1.5 x ATTEND_MAX_INFLIGHT_BYTES={budget} MiB): requests in flight together may have the process killed "
          "rather than refused; {fix} (docs/reliability.md)")


@pytest.mark.parametrize("device, budget, said", [
    ("cpu", "1073741824", _SHORT.format(idle=160, budget=1024,
                                        fix="set ATTEND_MAX_INFLIGHT_BYTES to at most 307582293 (293 MiB)")),
    ("cpu", "268435456", None),
    # A CUDA worker holds ~0.75 GiB idle: what fits a CPU worker does not fit it.
    ("cuda", "268435456", _SHORT.format(idle=800, budget=256, fix="give it more memory, or fewer ATTEND_WORKERS")),
], ids=["cpu-1GiB", "cpu-256MiB", "cuda-256MiB"])
def test_a_memory_limit_short_of_the_budget_is_said_at_the_start(tmp_path, device, budget, said):
    """Before, nothing said it: in 600 MiB, the default 1 GiB budget let requests in flight together have the
    process killed for memory, where the budget would have refused them (503). 256 MiB x 1.5 + 160 fits."""
    folder = _quota_cgroup(("memory.max", "629145600"), ("memory", "memory.limit_in_bytes", "629145600"))
    if folder is None:
        pytest.skip("a memory limit is set in a cgroup of the test's own, which needs root and a writable cgroup "
                    "filesystem: the project's machines have both")
    env = {"PATH": os.environ["PATH"], "ATTEND_MAX_INFLIGHT_BYTES": budget, "ATTEND_DEVICE": device,
           "ATTEND_MODEL_REPOSITORY": str(tmp_path / "nowhere")}  # then it stops: the warning comes before
    try:
        result = subprocess.run(["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "limited",
                                 sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
    finally:
        os.rmdir(folder)
    assert result.returncode == 1, result.stderr
    if said:
        assert said in result.stderr, result.stderr
    assert ("memory limit" in result.stderr) == bool(said), result.stderr
