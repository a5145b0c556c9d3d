"""Denormal results flushed to zero while a graph runs (ATTEND_FLUSH_DENORMALS, service.core.denormals): a run
flushes where the setting is on, and the thread's bits are as before once it returns (a warm-up on the caller's
thread leaves them too); the served answers differ by less than float32's smallest normal with the setting on
and off."""

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from service.core import denormals
from service.core.choice import Graph
from service.core.runtime import CPU, Registry
from tests.server import running_service

pytestmark = pytest.mark.skipif(not denormals.supported,
                                reason="MXCSR is x86-64's (glibc's fenv): elsewhere the service changes nothing")

TINY = np.finfo(np.float32).tiny  # float32's smallest normal


def _product_graph() -> Graph:
    """A graph of one Mul: x * y, in float32."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "y"], ["z"])], "mul",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy"],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return Graph("mul.onnx", CPU, session, ["z"], False)


def _in_new_thread(call, inherited: bool):
    """call() in a fresh thread whose bits start as `inherited`: (its result, the thread's flushing() after)."""
    out = {}

    def run():
        denormals.set_flush(inherited)
        out["result"] = call()
        out["flushing"] = denormals.flushing()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["result"], out["flushing"]


@pytest.fixture
def setting():
    yield
    denormals.enabled = True


@pytest.mark.parametrize("inherited", [False, True], ids=["thread IEEE", "thread flushing"])
@pytest.mark.parametrize("flush", [True, False], ids=["on", "off"])
def test_a_run_flushes_as_the_setting_says_and_leaves_the_threads_bits(setting, flush, inherited):
    graph = _product_graph()
    denormals.enabled = flush
    feed = {"x": np.array([1e-30], np.float32), "y": np.array([1e-10], np.float32)}
    result, flushing = _in_new_thread(lambda: graph.run(feed)["z"], inherited)
    assert flushing is inherited
    bits = int(result.view(np.uint32)[0])  # compared as bits: a thread with DAZ reads a denormal as 0
    if flush or inherited:
        assert bits == 0
    else:
        assert 0 < bits < int(np.array([TINY], np.float32).view(np.uint32)[0])  # a denormal, kept


@pytest.mark.parametrize("flush", [True, False])
def test_the_loader_sets_it_and_a_warm_up_leaves_the_callers_bits(repository: Path, setting, flush):
    registry, flushing = _in_new_thread(
        lambda: Registry.load(repository, "cpu", 1, graph_timing_s=0.2, flush_denormals=flush), inherited=False)
    assert denormals.enabled is flush
    assert flushing is False
    scores = np.array([[[0.0, -90.0, 1.0]]], np.float32)
    weights = registry.get("masked_softmax").run({"scores": scores, "valid_lens": np.array([[3]], np.int64)})
    expected = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose(weights["attention_weights"], expected, rtol=1e-6, atol=TINY)


def test_the_first_session_of_a_process_leaves_the_loading_threads_bits(repository: Path):
    """ONNX Runtime's first session made with session.set_denormal_as_zero set the bits on the thread that
    made it, for good: a caller that loaded the models (a test, the service's loading thread) then flushed
    its own NumPy's denormals, and hypothesis refused to make floats."""
    code = ("import sys; from pathlib import Path; from service.core import denormals; "
            "from service.core.runtime import Registry; "
            "Registry.load(Path(sys.argv[1]), 'cpu', 1, flush_denormals=True); print(denormals.flushing())")
    out = subprocess.run([sys.executable, "-c", code, str(repository)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False", out.stdout


@pytest.mark.slow
def test_the_served_answers_are_the_same_with_the_setting_on_and_off(repository: Path):
    body = {"model": "masked_softmax", "scores": [[[0.0, -90.0, 1.0]]], "valid_lens": [2]}
    answers = []
    for flush in ("1", "0"):
        with running_service(repository, ATTEND_FLUSH_DENORMALS=flush, ATTEND_GRAPH_TIMING_S="0") as (url, _):
            response = httpx.post(f"{url}/attend", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
    on, off = answers
    assert on["attention_weights"] == [[[1.0, 0.0, 0.0]]]  # exp(-90): a denormal, read 0
    np.testing.assert_allclose(off["attention_weights"], on["attention_weights"], rtol=0, atol=TINY)
