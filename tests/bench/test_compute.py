"""bench/compute.py on two small points: it exports the models afresh, times the CPU graph the service
serves against eager PyTorch, the decomposed graph and the floor, checks the numbers, and writes its
section into a markdown file with the command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow


def test_the_compute_table_is_written_with_every_column(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# x\n\n<!-- compute -->\nold\n<!-- /compute -->\n\nafter\n")
    result = subprocess.run([sys.executable, "bench/compute.py", "--sizes", "2x16", "1x40", "--repeats", "7",
                             "--out", str(doc)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- /compute -->\n\nafter\n")
    assert "command: `python bench/compute.py --sizes 2x16 1x40 --repeats 7 --out" in text
    rows = [line for line in text.splitlines() if line.startswith(("| dot_product", "| multi_head"))]
    assert [row.split(" | ")[1:3] for row in rows] == [
        [shape, per] for shape in ("2 x 16 x 16 x 64", "1 x 40 x 40 x 64", "2 x 16 x 16 x 100, 5 heads",
                                   "1 x 40 x 40 x 100, 5 heads") for per in ("per example", "per query")]
    for row in rows:
        cells = [c.strip(" *") for c in row.strip("|").split("|")]
        served, without, eager, decomposed, least, by_eager, by_floor = map(float, cells[3:10])
        assert min(served, without, eager, decomposed, least) > 0
        # the ratios are of the unrounded times: 2 decimals against ratios of 4-digit figures
        assert by_eager == pytest.approx(served / eager, rel=0.01, abs=0.01)
        assert by_floor == pytest.approx(served / least, rel=0.01, abs=0.01)
        out_diff, weights_diff = (float(x) for x in cells[11].split(" / "))
        assert out_diff < 1e-5 and weights_diff < 1e-5  # the served graph is the module's
    assert "dot_product: served 1/model.cpu.onnx (opset 24), decomposed 1/model.onnx" in text
    for kind in ("dot_product", "multi_head"):  # length 0: zeros from all three
        assert re.search(rf"- {kind}, rows of valid length 0: PyTorch: zero output and weights; served: zero "
                         r"output and weights; decomposed: zero output and weights", text)
