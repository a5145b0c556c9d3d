"""bench/longseq.py on the CPU at two small n: each point in a process of its own, both graphs of both
models, the table written into a markdown section from the results file; a point that fails (here: a time
limit too short to start) is a row of the table and the larger n are not tried; the kernels named from ONNX
Runtime's VERBOSE lines as its CUDA kernel of `Attention` writes them."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest

from export.repository import read_config
from tests.server import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import longseq  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return longseq.export(tmp_path_factory.mktemp("longseq") / "repo")


def _bench(*args, timeout=300):
    result = subprocess.run([sys.executable, "bench/longseq.py", *map(str, args)], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _rows(text):
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(("| dot_product", "| multi_head"))]


def test_the_models_are_exports_builders_with_the_benchs_sizes(models):
    assert read_config(models / "multi_head").hyperparameters == {
        "key_size": 512, "query_size": 512, "value_size": 512, "num_hiddens": 512, "num_heads": 8, "bias": False}
    for kind in ("dot_product", "multi_head"):
        assert set(read_config(models / kind).variants) == {"cpu", "cpu_outputs", "cuda_outputs"}


def test_the_table_has_both_graphs_of_both_models_at_each_n(models, tmp_path):
    doc, results = tmp_path / "benchmarks.md", tmp_path / "longseq.json"
    doc.write_text("# x\n\n<!-- longseq-cpu -->\nold\n<!-- /longseq-cpu -->\n\nafter\n")
    _bench("--device", "cpu", "--repository", models, "--sizes", 64, 128, "--repeats", 5, "--seconds", 0.1,
           "--results", results, "--out", doc)
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- /longseq-cpu -->\n\nafter\n")
    assert "command: `python bench/longseq.py --device cpu --repository" in text and ", no GPU used;" in text
    rows = _rows(text)
    assert [row[:2] for row in rows] == [["dot_product (d = 64)", "64"], ["dot_product (d = 64)", "128"],
                                         ["multi_head (8 heads of 64)", "64"], ["multi_head (8 heads of 64)", "128"]]
    for row in rows:
        decomposed, fused = float(row[2]), float(row[4])
        assert decomposed > 0 and fused > 0 and float(row[7]) == pytest.approx(decomposed / fused, rel=0.02, abs=0.01)
        for cell in (row[3], row[5]):  # resident MiB: the session's + the runs' peak
            session, runs = (float(x.replace(",", "")) for x in cell.split(" + "))
            assert session > 0 and runs >= 0
        assert row[6] == "CPU kernel" and float(row[8]) < 1e-5  # the same numbers from both graphs
    assert "- dot_product, the longest n served in one request: model.onnx 128 (the largest tried); " \
        "model.cpu.outputs.onnx 128 (the largest tried)" in text
    saved = json.loads(results.read_text())
    assert saved["device"] == "cpu" and saved["graphs"] == ["model.onnx", "model.cpu.outputs.onnx"]
    assert {(p["kind"], p["n"], p["graph"], p["status"]) for p in saved["points"]} == {
        (k, n, g, "ok") for k in ("dot_product", "multi_head") for n in (64, 128) for g in saved["graphs"]}
    assert all(p["runs"] >= 3 and p["finite"] and p["memory_source"] == "VmRSS / ru_maxrss" for p in saved["points"])
    # --report writes the same section from the results file, with the run's own stamp and command
    again = tmp_path / "again.md"
    again.write_text("<!-- longseq-cpu -->\n<!-- /longseq-cpu -->\n")
    _bench("--report", "--results", results, "--out", again)
    assert again.read_text().strip() == text[text.index("<!-- longseq-cpu -->"):text.index("\n\nafter")].strip()


def test_a_point_that_fails_is_a_row_and_larger_n_are_not_tried(models, tmp_path):
    results = tmp_path / "longseq.json"
    out = _bench("--device", "cpu", "--repository", models, "--kinds", "dot_product", "--sizes", 64, 128,
                 "--point-timeout", 0.05, "--results", results)
    points = json.loads(results.read_text())["points"]
    assert [(p["n"], p["status"]) for p in points] == [(64, "timeout"), (64, "timeout"), (128, "not run"),
                                                       (128, "not run")]
    assert points[2]["error"] == "failed at n = 64"
    assert _rows(out) == [["dot_product (d = 64)", "64", "timeout", "-", "timeout", "-", "-", "-", "-"],
                          ["dot_product (d = 64)", "128", "not run (failed at n = 64)", "-",
                           "not run (failed at n = 64)", "-", "-", "-", "-"]]
    assert "model.onnx none of the sizes tried" in out


def test_the_kernels_are_read_from_onnx_runtimes_verbose_lines():
    # The lines as onnxruntime 1.31.1's CUDA provider writes them (its library's strings), with the logger's prefix.
    log = "\n".join([
        "2026-11-28 10:00:00.1 [V:onnxruntime:Default, attention.cc:1451 ComputeInternal] ONNX Attention: using "
        "Memory Efficient Attention (batch=1, q_seq=512, total_seq=512, past=no, mask=no)",
        "[V:onnxruntime:Default, attention.cc:1482 ComputeInternal] Attention: using unified unfused path "
        "(is_gqa=0, head_size=20, softcap=0)",
        "[V:onnxruntime:Default, attention.cc:1400 ComputeInternal] ONNX Attention: using Flash Attention (batch=1)",
        "[V:onnxruntime:Default, attention.cc:1451 ComputeInternal] ONNX Attention: using Memory Efficient Attention",
        "ONNX Attention: using cuDNN SDPA (batch=1)",
    ])
    assert longseq.kernels_in(log) == ["MEA", "unfused", "Flash", "cuDNN SDPA"]
    assert longseq.kernels_in("[V:onnxruntime:, sequential_executor.cc:1 Execute] nothing of attention") == []
    library = Path(onnxruntime.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if library.is_file():  # onnxruntime-gpu here: the strings the regular expression reads are the library's own
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for text in (b"ONNX Attention: using Memory Efficient Attention", b"ONNX Attention: using Flash Attention",
                         b"Attention: using unified unfused path (is_gqa=", b"ONNX Attention: using cuDNN SDPA"):
                assert data.find(text) >= 0, text
