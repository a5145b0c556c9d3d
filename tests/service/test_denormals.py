"""Denormal results flushed to zero on the threads that run graphs (ATTEND_FLUSH_DENORMALS, service.core.denormals):
a thread's MXCSR bits follow the setting once it runs a graph, whatever it inherited; a denormal product then
reads 0; the served answers differ by less than float32's smallest normal with the setting on and off."""

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.core import denormals
from service.core.runtime import Registry
from tests.server import running_service

pytestmark = pytest.mark.skipif(not denormals.supported,
                                reason="MXCSR is x86-64's (glibc's fenv): elsewhere the service changes nothing")

SCORES = np.array([[[0.0, -90.0, 1.0]]], np.float32)  # exp(-91) is a float32 denormal (8e-40)


def _in_new_thread(call, inherited: bool):
    """call() in a fresh thread whose MXCSR bits start as `inherited`; (its result, the thread's
    flushing() after it, 1e-30 * 1e-10 in float32 there)."""
    out = {}

    def run():
        denormals.set_flush(inherited)
        out["result"] = call()
        out["flushing"] = denormals.flushing()
        out["product"] = np.float32(1e-30) * np.float32(1e-10)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["result"], out["flushing"], out["product"]


@pytest.fixture
def restore():
    yield
    denormals.enabled = True


@pytest.mark.parametrize("flush", [True, False])
def test_a_graphs_run_sets_its_threads_bits_as_the_setting_says(repository: Path, flush: bool, restore):
    model = Registry.load(repository, "cpu", 1, warmup=False, flush_denormals=flush).get("masked_softmax")
    feed = {"scores": SCORES, "valid_lens": np.array([[3]], np.int64)}
    result, flushing, product = _in_new_thread(lambda: model.run(feed), inherited=not flush)
    assert flushing is flush
    assert bool(product == 0) is flush
    if not flush:
        assert 0 < product < np.finfo(np.float32).tiny  # a denormal, kept
    expected = np.exp(SCORES - SCORES.max()) / np.exp(SCORES - SCORES.max()).sum()
    np.testing.assert_allclose(result["attention_weights"], expected, rtol=1e-6, atol=1e-37)


def test_the_thread_follows_a_new_setting(restore):
    """Set once a thread, but again where a load changed the setting (a reload with another repository
    keeps the process)."""
    denormals.enabled = True
    _, flushing, _ = _in_new_thread(denormals.on_this_thread, inherited=False)
    assert flushing
    state = {}

    def twice():
        denormals.enabled = True
        denormals.on_this_thread()
        state["first"] = denormals.flushing()
        denormals.enabled = False
        denormals.on_this_thread()
        return denormals.flushing()

    assert _in_new_thread(twice, inherited=False)[0] is False
    assert state["first"] is True


@pytest.mark.slow
def test_the_served_answers_are_the_same_with_the_setting_on_and_off(repository: Path):
    body = {"model": "masked_softmax", "scores": SCORES.tolist(), "valid_lens": [2]}
    answers = []
    for flush in ("1", "0"):
        with running_service(repository, ATTEND_FLUSH_DENORMALS=flush, ATTEND_GRAPH_TIMING_S="0") as (url, _):
            response = httpx.post(f"{url}/attend", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
    on, off = answers
    assert on["attention_weights"] == [[[1.0, 0.0, 0.0]]]  # exp(-90): a denormal, read 0
    tiny = np.finfo(np.float32).tiny
    np.testing.assert_allclose(off["attention_weights"], on["attention_weights"], rtol=0, atol=tiny)
