"""bench/engine.py for real, short, at 1 and 2 processes on the CPU execution provider: every design measured,
every answer checked against the client's own inputs, the engine's batches joined across front ends, and the
report from the results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow

MODES = ("workers", "workers-batched", "engine", "engine-batched")


@pytest.fixture(scope="module")
def run(repository, tmp_path_factory):
    """(results, stdout, docs) of one short run, its report written into a docs file."""
    folder = tmp_path_factory.mktemp("engine")
    docs = folder / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- engine-cpu -->\nold\n<!-- /engine-cpu -->\n")
    results = folder / "engine.json"
    done = subprocess.run([sys.executable, "bench/engine.py", "--device", "cpu", "--processes", "1,2",
                           "--concurrency", "6", "--seconds", "1", "--warmup", "0.5", "--repository", str(repository),
                           "--results", str(results), "--out", str(docs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text()), done.stdout, docs


def test_every_design_is_measured_and_every_answer_is_its_clients(run):
    results, _, _ = run
    points = {(p["mode"], p["processes"]): p for p in results["points"]}
    cores = sorted(os.sched_getaffinity(0))
    assert set(points) == {(mode, n) for mode in MODES for n in (1, 2)}
    for (mode, n), p in points.items():
        assert p["wrong"] == 0 and p["requests"] > 5 and p["rps"] == pytest.approx(p["requests"] / 1.0), (mode, n)
        assert 0 < p["p50_ms"] <= p["p99_ms"], (mode, n)
        assert p["cores"]["processes"] == sorted(set(cores[:n] or cores))
        if mode.startswith("engine"):  # cores of its own where there are as many again
            assert p["cores"]["engine"] == (cores[n:2 * n] or cores[-1:])
        else:
            assert "engine" not in p["cores"]
        if mode in ("workers", "engine"):  # one request a run
            assert p["batch"] == 1.0
        else:  # six clients' requests waiting together are joined into one run
            assert 1.0 < p["batch"] <= 6, (mode, n, p["batch"])


def test_the_clients_inputs_differ_so_a_mixed_up_slot_shows(repository):
    sys.path.insert(0, str(ROOT / "bench"))
    from engine import feed_of

    feeds = [feed_of(repository / "dot_product", c) for c in range(6)]
    for name in feeds[0]:
        arrays = [f[name] for f in feeds]
        assert all(a.shape == arrays[0].shape for a in arrays)
        if name != "valid_lens":
            assert len({a.tobytes() for a in arrays}) == 6, name
    assert len({f["valid_lens"].tobytes() for f in feeds}) > 1
    assert all(np.all((f["valid_lens"] >= 1) & (f["valid_lens"] <= 128)) for f in feeds)


def test_the_report_weighs_each_engine_against_the_workers_with_the_same_batching(run):
    results, stdout, docs = run
    lines = stdout.rstrip("\n").splitlines()
    by = {(p["mode"], p["processes"]): p for p in results["points"]}
    for (mode, n), p in by.items():
        row = next(x for x in lines if x.startswith(f"| {mode} | {n} | 6 | "))
        cells = [x.strip() for x in row.strip("|").split("|")]
        alike = by[("workers-batched" if mode.endswith("batched") else "workers", n)]
        assert cells[3] == f"{p['rps']:.0f}" and cells[4] == f"{p['rps'] / alike['rps']:.2f}x"
        assert cells[5] == f"{p['p50_ms']:.2f}" and cells[6] == f"{p['p99_ms']:.2f}"
    assert lines[-2] == "Wrong answers (each client's first and every 50th, against its own CPU session's): 0."
    ratios = {mode: by[(mode, 2)]["rps"] / by[("workers", 2)]["rps"] for mode in MODES[1:]}
    assert lines[-1] == "requests/s at 2 processes against workers (ATTEND_WORKERS): " + ", ".join(
        f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items())
    text = docs.read_text()
    assert "<!-- engine-cpu -->\nRun " in text and "old" not in text and lines[-1] in text
