"""bench/scaling.py for real, short, at 1 and 2 processes on the CPU execution provider: every point of every
row measured against the service and (W1) the plain server with as many workers, its results file, the
table its report prints from that file, and the one line it ends with."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow

ROWS = ("W1", "W2bin", "W1grpc")
COMMAND = ["bench/scaling.py", "--device", "cpu", "--processes", "1,2", "--rows", ",".join(ROWS), "--duration", "1",
           "--warmup", "0", "--concurrency", "2", "--largest-concurrency", "4"]


@pytest.fixture(scope="module")
def sweep(repository, tmp_path_factory):
    """(results, stdout, the docs file) of one short sweep."""
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed: `make tools` installs it (apt-get install wrk)", pytrace=False)
    folder = tmp_path_factory.mktemp("scaling")
    docs = folder / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- scaling -->\nold 9.99x\n<!-- /scaling -->\n\nafter\n")
    results = folder / "scaling.json"
    done = subprocess.run([sys.executable, *COMMAND, "--repository", str(repository), "--results", str(results),
                           "--out", str(docs)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text()), done.stdout, docs, results, done.stderr


def test_every_point_is_measured_with_its_cores_and_workers(sweep):
    results, _, _, _, stderr = sweep
    cores = sorted(os.sched_getaffinity(0))
    assert results["settings"]["devices"] == ["cpu"] and results["settings"]["processes"] == [1, 2]
    for n in (1, 2):
        layout = results["settings"]["layout"][str(n)]
        assert layout["service_cores"] == cores[:n]
        assert layout["load_cores"] == (cores[2:4] if len(cores) >= 4 else cores[n:] or cores)
        assert layout["shared"] == bool(set(layout["service_cores"]) & set(layout["load_cores"]))
    if len(cores) < 4:  # said where the load generator shares the service's cores
        assert "shared with the service" in stderr
    expected = {("cpu", n, row, c, server) for n, cs in ((1, (2,)), (2, (2, 4))) for row in ROWS for c in cs
                for server in (("service", "plain") if row == "W1" else ("service",))}
    points = {(p["device"], p["processes"], p["row"], p["concurrency"], p["server"]): p for p in results["points"]}
    assert set(points) == expected and len(results["points"]) == len(expected)
    for key, p in points.items():
        assert "error" not in p and "failed" not in p, (key, p)
        assert p["requests"] > 10 and p["rps"] == pytest.approx(p["requests"] / p["seconds"], rel=0.01), key
        assert 0 < p["p50_ms"] <= p["p99_ms"], key
        assert 0 <= p["service_busy"] <= 1 and 0 <= p["load_busy"] <= 1, key
        assert "gpu_util" not in p  # no GPU sampled on the CPU provider
        if key[1] == 2 and key[4] == "service":  # each worker's share, from its own counter
            assert len(p["per_worker_rps"]) == 2
            assert sum(p["per_worker_rps"]) == pytest.approx(p["rps"], rel=0.25), key
        else:
            assert "per_worker_rps" not in p
    servers = {(s["server"], s["processes"]): s for s in results["servers"]}
    assert set(servers) == {("service", 1), ("plain", 1), ("service", 2), ("plain", 2)}
    for (_, n), s in servers.items():
        for moment in ("at_start", "at_end"):
            assert s[moment]["workers"] == n
            assert len(s[moment]["workers_rss_mib"]) == n and all(r > 20 for r in s[moment]["workers_rss_mib"])
            assert len(s[moment]["supervisor_rss_mib"]) == (1 if n == 2 else 0)
    for n in (1, 2):  # the choice of graphs the sweep ran with: W2bin's model has three on the CPU (W1's one)
        graphs = servers[("service", n)]["graphs"]
        assert list(graphs) == ["dot_product"], graphs
        assert re.fullmatch(r"with the weights: 1/model\.\S+ on CPU(.*); without: 1/model\.\S+ on CPU(.*)",
                            graphs["dot_product"]), graphs
    assert results["skipped"] == [] and 0 < results["seconds"] < 600
    assert re.search(r"the sweep took \d+ s", stderr)


def test_the_report_prints_the_table_and_ends_with_the_scaling_line(sweep):
    results, stdout, _, _, _ = sweep
    lines = stdout.rstrip("\n").splitlines()
    points = {(p["processes"], p["row"], p["concurrency"], p["server"]): p for p in results["points"]}
    for (n, row, c, server), p in points.items():
        if server == "plain":
            continue
        line = next(x for x in lines if x.startswith(f"| cpu | {row} | {n} | {c} | "))
        cells = [x.strip() for x in line.strip("|").split("|")]
        assert cells[4] == f"{p['rps']:.0f}" and cells[6] == f"{p['p50_ms']:.2f}" and cells[7] == f"{p['p99_ms']:.2f}"
        assert cells[5] == f"{p['rps'] / points[(1, row, 2, 'service')]['rps']:.2f}x"
        plain = points.get((n, row, c, "plain"))
        assert cells[14] == (f"{plain['rps']:.0f}" if plain else "-")
        assert cells[15] == (f"{p['rps'] / plain['rps']:.2f}x" if plain else "-")
    # Last: each row's best requests/s at 2 processes over its requests/s at 1.
    expected = {row: max(points[(2, row, c, "service")]["rps"] for c in (2, 4)) / points[(1, row, 2, "service")]["rps"]
                for row in ROWS}
    assert lines[-1] == "scaling at 2: " + ", ".join(f"{row} {expected[row]:.2f}x" for row in ROWS)
    assert sum(line.startswith("scaling at ") for line in lines) == 1
    assert lines[-3].startswith("p99 at c=4 with 2 processes against c=2 with 1 (cpu): W1 ")
    for s in results["servers"]:
        if s["server"] == "service":
            assert f"| cpu | {s['processes']} | dot_product | {s['graphs']['dot_product']} |" in lines


def test_the_report_of_the_file_is_the_same_and_goes_into_the_docs(sweep):
    results, stdout, docs, path, _ = sweep
    again = subprocess.run([sys.executable, "bench/scaling.py", "--report", "--results", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=True)
    assert again.stdout == stdout
    text = docs.read_text()
    assert text.startswith(f"# Benchmarks\n\n<!-- scaling -->\nRun {results['date']} on {results['machine']}; "
                           f"command: `{results['command']}`\n")
    assert results["command"].startswith("python bench/scaling.py --device cpu --processes 1,2 ")
    assert "9.99x" not in text and text.endswith("<!-- /scaling -->\n\nafter\n")
    assert stdout.rstrip("\n").splitlines()[-1] + "\n<!-- /scaling -->" in text
