"""bench/worker_memory.py on the CPU: each configuration a process of its own that loads the whole repository as
the service does and serves it from its threads; the table its report writes from the results file; a
configuration ONNX Runtime refuses is a row, not the end of the bench."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from export.repository import read_config
from tests.server import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import worker_memory  # noqa: E402

pytestmark = pytest.mark.slow


def test_each_configuration_loads_and_serves_the_repository(repository, tmp_path):
    doc, results = tmp_path / "benchmarks.md", tmp_path / "memory.json"
    doc.write_text("# x\n\n<!-- worker-memory-cpu -->\nold\n<!-- /worker-memory-cpu -->\n\nafter\n")
    done = subprocess.run([sys.executable, "bench/worker_memory.py", "--device", "cpu", "--repository", str(repository),
                           "--runs", "3", "--results", str(results), "--out", str(doc)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(results.read_text())
    assert [row["config"] for row in saved["rows"]] == ["served", "one-thread"]  # the others are CUDA's
    models = sorted(p.parent.name for p in repository.glob("*/config.json"))
    # On the CPU: model.onnx and the CPU's variants (model.cpu.onnx, model.cpu.outputs.onnx), not CUDA's.
    graphs = sum(1 + sum(v.startswith("cpu") for v in read_config(repository / name).variants) for name in models)
    for row in saved["rows"]:
        assert row["status"] == "ok", row
        assert row["sessions"] == {"cuda": 0, "cpu": graphs, "models": len(models)}
        assert row["threads"] == (1 if row["config"] == "one-thread" else 2)
        start, loaded, served = (row[stage]["resident_mib"] for stage in ("start", "loaded", "served"))
        assert 20 < start < loaded <= served * 1.05 < 1000, row  # the sessions take memory; the runs hold little
        assert row["gpu_before_mib"] is None and row["served"]["gpu_used_mib"] is None
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- /worker-memory-cpu -->\n\nafter\n")
    assert "command: `python bench/worker_memory.py --device cpu" in text and ", no GPU used;" in text
    lines = [line for line in text.splitlines() if line.startswith(("| served", "| one-thread"))]
    assert [line.split(" | ")[1:3] for line in lines] == [[f"0 + {graphs} ({len(models)} models)", n] for n in "21"]


def test_a_configuration_that_fails_is_a_row(tmp_path):
    row = worker_memory._run({"device": "cpu", "config": "served", "repository": str(tmp_path / "none"),
                              "threads": 1, "runs": 1}, 60)
    assert row["status"] == "failed" and row["error"].startswith("StartupError: "), row
    row["error"] += " | and\na second line"  # as ONNX Runtime's can be
    results = {"device": "cuda", "runs": 1, "onnxruntime": "x", "rows": [{"config": "served", **row}]}
    line = worker_memory.table(results)[2]
    assert line.startswith("| served | failed: StartupError: ") and line.count("|") == 10, line  # nine cells
    assert line.endswith(" / and a second line |" + " |" * 7)
