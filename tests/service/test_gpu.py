"""What only a GPU can show: every kind of the default repository really runs on ONNX Runtime's CUDA
execution provider, and gives the CPU's numbers (TF32 off, as the service's default), through the
sessions and through the service. `pytest -m gpu` on a machine with an NVIDIA GPU and onnxruntime-gpu
(../shared/GPU.md); skipped elsewhere, saying why."""

from __future__ import annotations

import numpy as np
import pytest

from export.repository import KINDS, example_feed
from service.core.runtime import CPU, CUDA, Registry

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-5  # fp32 against fp32: TF32 would be ~1e-3 off (ATTEND_CUDA_TF32 is off by default)
SIZES = [{"batch": 2, "n_q": 3, "n_k": 5, "n": 4, "d": 8, "value_size": 6},
         {"batch": 7, "n_q": 33, "n_k": 65, "n": 48, "d": 64, "value_size": 16}]


@pytest.fixture(scope="module")
def cuda_registry(repository):
    import onnxruntime as ort

    if CUDA not in ort.get_available_providers():
        pytest.skip("no CUDA execution provider in this onnxruntime (onnxruntime-gpu is needed)")
    try:
        registry = Registry.load(repository, "cuda", 1)
    except Exception as e:  # onnxruntime-gpu without a GPU, driver, CUDA 13 or cuDNN 9: the load says which
        pytest.skip(f"CUDA cannot be used here: {e}")
    return registry


@pytest.fixture(scope="module")
def cpu_registry(repository):
    return Registry.load(repository, "cpu", 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", SIZES, ids=["small", "larger"])
def test_every_kind_runs_on_cuda_with_the_cpus_numbers(cuda_registry, cpu_registry, kind, sizes):
    on_gpu, on_cpu = cuda_registry.get(kind), cpu_registry.get(kind)
    assert on_gpu.provider == CUDA and on_gpu.session.get_providers()[0] == CUDA
    assert on_cpu.provider == CPU
    # CUDA runs model.onnx (its Attention kernel refuses the weights output); the CPU its own graph where there is one.
    assert on_gpu.model_file == "1/model.onnx"
    assert on_cpu.model_file == ("1/model.cpu.onnx" if on_cpu.config.variants else "1/model.onnx")
    feed = example_feed(kind, on_gpu.config.hyperparameters, sizes, np.random.default_rng(0))
    if "valid_lens" in feed:  # lengths of every kind: none, some, all
        lens = feed["valid_lens"]
        lens[:, :] = np.arange(lens.size).reshape(lens.shape) % (lens.max() + 1)
    got, want = on_gpu.run(feed), on_cpu.run(feed)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)


def test_the_service_says_it_serves_on_cuda(cuda_registry, repository):
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.http.app import create_app
    from service.http.schemas import toy_request

    settings = Settings(model_repository=repository, device="cuda", intra_op_threads=1)
    with TestClient(create_app(settings)) as client:
        assert {m["provider"] for m in client.get("/models").json()["models"]} == {CUDA}
        outputs = client.post("/attend", json=toy_request()).json()["outputs"]
    np.testing.assert_allclose(outputs, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)
