"""scripts/gpu_check.sh runs only on a lent GPU machine, whose minutes are few: every bench command it runs, and
every --report command it names for afterwards, must parse with today's options, and its gpu tests be there."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from tests.server import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
VARIABLES = {"$PY": "python", "$OUT": "out", "$REPOSITORY": "model_repository", "$LONGSEQ": "build/longseq"}


def commands() -> list[list[str]]:
    """Each `bench/*.py` command of the script, its steps' and its comments' (the --report ones), as argv."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.match(r'(?:step \S+ \d+ "\$PY" |#\s+python )(bench/\w+\.py\b.*)', line)
        if match:
            words = match.group(1)
            for name, value in VARIABLES.items():
                words = words.replace(f'"{name}"', value).replace(name, value)
            found.append(shlex.split(words))
    return found


class Parsed(Exception):  # noqa: N818 (the namespace a parse made, raised to stop the bench there)
    pass


@pytest.mark.parametrize("argv", commands(), ids=lambda argv: " ".join(argv[:2]))
def test_each_bench_command_parses(argv, monkeypatch, capsys):
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(ROOT))
    try:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as e:  # argparse's error: the option the script passes is gone or renamed
        pytest.fail(f"{' '.join(argv)}: exit {e.code}: {capsys.readouterr().err[-500:]}")
    except Parsed as parsed:
        assert vars(parsed.args[0]), argv
    else:
        pytest.fail(f"{argv[0]} parsed no arguments")


def test_the_script_runs_each_bench_and_names_each_report():
    runs = sorted(argv[0] for argv in commands() if "--report" not in argv)
    reports = sorted(argv[0] for argv in commands() if "--report" in argv)
    assert runs == reports == ["bench/engine.py", "bench/longseq.py", "bench/scaling.py",
                                   "bench/worker_memory.py"], (runs, reports)


def test_its_gpu_tests_are_collected():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                           "gpu", "tests/service/test_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    collected = re.search(r"(\d+)/\d+ tests collected|(\d+) tests collected", done.stdout)
    assert collected and int(collected.group(1) or collected.group(2)) >= 10, done.stdout[-2000:]
    assert "tests/service/test_gpu.py" in SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
