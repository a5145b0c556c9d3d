"""bench/longseq.py on the CPU at two small n: each point in a process of its own, the three graphs of both
models (model.onnx, the served graph without weights, CUDA's graph in fp16), the table written into a
markdown section from the results file; a point that fails (here: a time
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
        config = read_config(models / kind)
        assert set(config.variants) == {"cpu", "cpu_outputs", "cuda_outputs"}
        assert (models / kind / str(config.version) / longseq.HALF).is_file()  # not a variant: the bench's own


def test_the_table_has_every_graph_of_both_models_at_each_n(models, tmp_path):
    doc, results = tmp_path / "benchmarks.md", tmp_path / "longseq.json"
    doc.write_text("# x\n\n<!-- longseq-cpu -->\nold\n<!-- /longseq-cpu -->\n\nafter\n")
    _bench("--device", "cpu", "--repository", models, "--sizes", 64, 128, "--repeats", 5, "--seconds", 0.1,
           "--results", results, "--out", doc)
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- /longseq-cpu -->\n\nafter\n")
    assert "command: `python bench/longseq.py --device cpu --repository" in text and ", no GPU used;" in text
    rows = _rows(text)
    graphs = ["model.onnx", "model.cpu.outputs.onnx", "model.cuda.outputs.fp16.onnx"]
    assert [row[:3] for row in rows] == [[f"{kind}", f"{n}", graph]
                                         for kind in ("dot_product (d = 64)", "multi_head (8 heads of 64)")
                                         for n in (64, 128) for graph in graphs]
    for base, served, half in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        assert base[5:] == ["-", "-", "-"]  # model.onnx: no Attention node, the reference of the ratios
        for row in (served, half):
            assert float(row[6]) == pytest.approx(float(base[3]) / float(row[3]), rel=0.02, abs=0.01)
            assert row[5] == "CPU kernel"
        assert float(served[7]) < 1e-5  # the served graph: model.onnx's numbers
        assert 1e-6 < float(half[7]) < 2e-3  # fp16: its rounding, within export.fused.HALF_TOLERANCE
        for row in (base, served, half):  # resident MiB: the session's + the runs' peak (this process's, not
            session, runs = (float(x.replace(",", "")) for x in row[4].split(" + "))  # the bench's, forked)
            assert float(row[3]) > 0 and 0 < session < 100 and 0 <= runs < 50
    assert "- dot_product, the longest n served in one request: model.onnx 128 (the largest tried); " \
        "model.cpu.outputs.onnx 128 (the largest tried); model.cuda.outputs.fp16.onnx 128 (the largest tried)" in text
    saved = json.loads(results.read_text())
    assert saved["device"] == "cpu" and saved["graphs"] == graphs
    assert {(p["kind"], p["n"], p["graph"], p["status"]) for p in saved["points"]} == {
        (k, n, g, "ok") for k in ("dot_product", "multi_head") for n in (64, 128) for g in saved["graphs"]}
    assert all(p["runs"] >= 3 and p["finite"] and p["memory_source"] == "VmRSS / VmHWM" for p in saved["points"])
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
    assert [(p["n"], p["status"]) for p in points] == [(64, "timeout")] * 3 + [(128, "not run")] * 3
    assert points[3]["error"] == "failed at n = 64"
    graphs = ["model.onnx", "model.cpu.outputs.onnx", "model.cuda.outputs.fp16.onnx"]
    assert _rows(out) == [["dot_product (d = 64)", "64", g, "timeout", "-", "-", "-", "-"] for g in graphs] + [
        ["dot_product (d = 64)", "128", g, "not run (failed at n = 64)", "-", "-", "-", "-"] for g in graphs]
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


def test_a_points_memory_is_its_own_not_its_parents(models):
    """A point's process starts as a fork of the bench (here pytest, torch loaded): the runs' peak is the
    point's own (VmHWM, reset by exec), not the parent's size at the fork (ru_maxrss keeps it)."""
    import re

    parent = int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
    config = read_config(models / "dot_product")
    spec = {"device": "cpu", "path": str(models / "dot_product" / config.model_file), "kind": "dot_product",
            "n": 64, "lengths": "example", "repeats": 3, "seconds": 0.1}
    point = longseq._run_point(spec, timeout=60)
    assert point["status"] == "ok" and parent > 150, (point, parent)
    assert 0 < point["session_mib"] < 50 and 0 <= point["run_mib"] < 50, point
