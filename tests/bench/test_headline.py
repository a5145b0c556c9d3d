"""README's one figure (`<!-- bench-headline -->`), written by `make bench` (bench/run.py --headline) from the
run's results: the service's requests/s beside the plain server's, with the run's date and command."""

import json
import subprocess
import sys

import pytest

from tests.bench import test_bench
from tests.server import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import run  # noqa: E402


def test_the_headline_gives_w1_at_the_highest_concurrency_beside_the_plain_server(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench-headline -->\nold 9.99x\n<!-- /bench-headline -->\nafter\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(test_bench.results()))
    done = subprocess.run([sys.executable, "bench/run.py", "--report", str(results), "--headline", str(readme)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("intro\n<!-- bench-headline -->\nRun 2026-11-25 11:00 UTC on a test machine; "
                           "command: `python bench/run.py --rounds 3`\n\n")
    assert text.endswith("<!-- /bench-headline -->\nafter\n") and "9.99x" not in text
    # W1 at c=16: medians of the rounds (plain 100, 120, 110; service 150, 168, 121) and of the paired ratios.
    assert "**150 requests/s** from the service on one core, against **110** from the plain" in text
    assert "the service is 1.40x as fast. p99 latency: 4.0 ms against 8.0 ms." in text
    assert "The load: W1, additive" in text and "16 connections" in text and "Medians of 3 rounds." in text


def test_the_headline_needs_both_servers_on_its_row():
    results = test_bench.results()
    results["points"] = [p for p in results["points"] if not (p["row"] == "W1" and p["server"] == "plain")]
    with pytest.raises(SystemExit, match="--headline needs row W1"):
        run.headline(results)


def test_make_bench_writes_the_readmes_figure():
    made = subprocess.run(["make", "-n", "bench", "VENV=/nonexistent/venv"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert "--out docs/benchmarks.md --headline README.md" in made.stdout
    assert (ROOT / "README.md").read_text().count("<!-- bench-headline -->") == 1
