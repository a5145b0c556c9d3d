"""What only a GPU can show: every kind of the default repository really runs on ONNX Runtime's CUDA
execution provider, and gives the CPU's numbers (TF32 off, as the service's default), through the
sessions and through the service; a batch without weights runs CUDA's graph without them
(model.cuda.outputs.onnx), on the fused kernel ONNX Runtime's VERBOSE log names, to the CPU's numbers.
`pytest -m gpu` on a machine with an NVIDIA GPU and onnxruntime-gpu (../shared/GPU.md); skipped elsewhere,
saying why."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from export.fused import FUSED_KINDS
from export.repository import KINDS, example_feed
from service.core.runtime import CPU, CUDA, Registry
from service.core.sessions import stderr_captured
from tests.server import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import longseq  # noqa: E402

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-5  # fp32 against fp32: TF32 would be ~1e-3 off (ATTEND_CUDA_TF32 is off by default)
# The memory-efficient kernel's fp32 GEMMs are cutlass's 3xTF32 (OpMultiplyAddFastF32: near fp32, not
# cuBLAS's rounding) and its softmax is online (rescaled block by block): another order of the same sums.
FUSED_TOLERANCE = 1e-4
SIZES = [{"batch": 2, "n_q": 3, "n_k": 5, "n": 4, "d": 8, "value_size": 6},
         {"batch": 7, "n_q": 33, "n_k": 65, "n": 48, "d": 64, "value_size": 16}]
# n_k a multiple of 4 (the mask's bias rows aligned: the memory-efficient kernel takes it) and head sizes of 8.
FUSED_SIZES = [*SIZES, {"batch": 3, "n_q": 40, "n_k": 64, "n": 64, "d": 64, "value_size": 64}]


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
    version = on_gpu.config.version
    assert on_gpu.model_file == f"{version}/model.onnx"
    assert on_cpu.model_file == (f"{version}/model.cpu.onnx" if on_cpu.config.variants else f"{version}/model.onnx")
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
        for kind in FUSED_KINDS:  # what a batch without weights runs on CUDA
            described = client.get(f"/models/{kind}").json()
            assert described["model_file_without_weights"] == f"{described['version']}/model.cuda.outputs.onnx"
        outputs = client.post("/attend", json=toy_request()).json()["outputs"]
    np.testing.assert_allclose(outputs, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)


def _lengths(feed, form):
    """valid_lens of `feed` made one an example (1-D lengths, as the service feeds them) or one a query, a
    0 (attends to nothing) and every key among them."""
    lens = feed["valid_lens"]
    batch, n_q = lens.shape
    n_k = int(lens.max())
    per_example = np.arange(batch) * n_k // max(batch - 1, 1)  # 0 ... n_k
    lens[:, :] = per_example[:, None] if form == "1d" else np.arange(lens.size).reshape(lens.shape) % (n_k + 1)
    return lens


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize("sizes", FUSED_SIZES, ids=["small", "larger", "aligned"])
@pytest.mark.parametrize("form", ["1d", "2d"])
def test_a_batch_without_weights_runs_cudas_graph_with_the_cpus_numbers(cuda_registry, cpu_registry, kind, sizes,
                                                                        form):
    """model.cuda.outputs.onnx, opened on CUDA beside model.onnx and named by GET /models/{name}: the
    outputs of the CPU's graph, lengths one an example (nonpad_kv_seqlen) and one a query (the mask), rows
    of valid length 0 zeros."""
    on_gpu, on_cpu = cuda_registry.get(kind), cpu_registry.get(kind)
    version = on_gpu.config.version
    assert on_gpu.model_file_without_weights == f"{version}/model.cuda.outputs.onnx"
    assert on_gpu.describe()["model_file_without_weights"] == on_gpu.model_file_without_weights
    assert on_gpu.session_without_weights.get_providers()[0] == CUDA
    feed = example_feed(kind, on_gpu.config.hyperparameters, sizes, np.random.default_rng(1))
    lens = _lengths(feed, form)
    got, want = on_gpu.run(feed, weights=False), on_cpu.run(feed, weights=False)
    assert set(got) == {"outputs"}
    np.testing.assert_allclose(got["outputs"], want["outputs"], rtol=FUSED_TOLERANCE, atol=FUSED_TOLERANCE)
    assert (lens == 0).any() and np.all(got["outputs"][lens == 0] == 0)
    # the batch that wants the weights still runs model.onnx, with the same outputs
    np.testing.assert_allclose(on_gpu.run(feed)["outputs"], got["outputs"], rtol=FUSED_TOLERANCE, atol=FUSED_TOLERANCE)


def _kernels(path, feed):
    """The kernels ONNX Runtime's VERBOSE log names for one run of the graph at `path` on CUDA (the kernel
    logs through the default logger; the session's, made meanwhile, takes its severity too)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(0)
    try:
        with stderr_captured() as captured:
            session = ort.InferenceSession(str(path), providers=[(CUDA, {"use_tf32": "0"})])
            session.run(["outputs"], feed)
    finally:
        ort.set_default_logger_severity(2)  # ONNX Runtime's default: warnings
    assert session.get_providers()[0] == CUDA
    return longseq.kernels_in(captured[0])


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_lengths_one_an_example_run_the_memory_efficient_kernel(cuda_registry, repository, kind):
    """fp32, heads of 8 or more (multi_head's 20 padded to 24), no weights, nonpad_kv_seqlen: the
    memory-efficient kernel (Flash takes fp16 and bf16 only); with the mask (2-D lengths) too where n_k is
    a multiple of 4, the unfused kernel where it is not; dot_product with a d not a multiple of 8, unfused."""
    model = cuda_registry.get(kind)
    path = repository / kind / model.model_file_without_weights
    unaligned = {**FUSED_SIZES[2], "n_k": 63, "n": 63}
    for sizes, form, kernel in ((FUSED_SIZES[2], "1d", "MEA"), (FUSED_SIZES[1], "1d", "MEA"),
                                (FUSED_SIZES[2], "2d", "MEA"), (unaligned, "2d", "unfused")):
        feed = example_feed(kind, model.config.hyperparameters, sizes, np.random.default_rng(2))
        _lengths(feed, form)
        assert _kernels(path, feed) == [kernel], (sizes, form)
    if kind == "dot_product":
        feed = example_feed(kind, model.config.hyperparameters, {**FUSED_SIZES[2], "d": 7}, np.random.default_rng(3))
        assert _kernels(path, feed) == ["unfused"]


def test_the_gpu_budget_refuses_a_run_before_it_runs_and_serves_the_next(cuda_registry, repository):
    """On CUDA the default ATTEND_MAX_DEVICE_BYTES is a share of the GPU's memory (NVML); a request whose run
    would pass a smaller one is a 413 naming the setting, before it runs, and the next request is served."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from service.config import Settings
    from service.core.gpu import SHARE, WORKER_BYTES, total_memory
    from service.http.app import create_app
    from tests.service.test_device_budget import dot_product_body, run_bytes

    total = total_memory()
    assert total and total > 1 << 30, "NVML must read the GPU's memory: nvidia-ml-py (the gpu extra)"
    # The fixed choice: a batch without weights runs the fused graph at every size (the timed choice costs a
    # job by the graphs its batch may run: test_the_timed_choice_on_cuda).
    settings = Settings(model_repository=repository, device="cuda", intra_op_threads=1, graph_timing_s=0)
    with TestClient(create_app(settings)) as client:
        assert client.app.state.dataplane.device_budget.limit == int(total * SHARE) - WORKER_BYTES
        families = {f.name: [s.value for s in f.samples]  # the default budget exported, nothing in flight
                    for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert families["attend_device_bytes_limit"] == [int(total * SHARE) - WORKER_BYTES]
        assert families["attend_device_bytes"] == [0]
    limited = settings.model_copy(update={"max_device_bytes": run_bytes(64)})
    with TestClient(create_app(limited)) as client:
        refused = client.post("/attend", json=dot_product_body(128))
        assert refused.status_code == 413 and "ATTEND_MAX_DEVICE_BYTES" in refused.json()["error"]["message"]
        assert "GPU memory" in refused.json()["error"]["message"]
        served = client.post("/attend", json=dot_product_body(64))
        assert served.status_code == 200 and np.asarray(served.json()["outputs"]).shape == (1, 64, 4)
        # Without weights, one length an example: the fused kernel keeps no scores, so 128 fits where it did not.
        body = dot_product_body(128) | {"return_weights": False}
        outputs_only = client.post("/attend", json=body)
        assert outputs_only.status_code == 200, outputs_only.text
        assert client.app.state.dataplane.device_budget.used == 0


def test_workers_auto_count_what_the_gpu_holds(cuda_registry, caplog):
    """ATTEND_WORKERS=auto on this GPU: at most 8, each with what a worker holds and the least budget within 80%
    of its memory; one worker more than that is warned of at the start (`python -m service`)."""
    from service.__main__ import _warn_of_the_gpu_memory
    from service.config import Settings, usable_cores
    from service.core.gpu import MIN_BUDGET, SHARE, WORKER_BYTES, total_memory

    total = total_memory()
    assert total, "NVML must read the GPU's memory: nvidia-ml-py (the gpu extra)"
    workers = Settings(workers="auto", device="cuda").workers
    fits = int(total * SHARE) // (WORKER_BYTES + MIN_BUDGET)
    assert workers == max(1, min(usable_cores(), 8, fits)), (workers, usable_cores(), total)
    print(f"ATTEND_WORKERS=auto on {total / 2**30:.1f} GiB, {usable_cores()} cores: {workers}")
    with caplog.at_level("WARNING", logger="service"):
        if fits >= 2:  # what fits: no warning (one worker never warns)
            _warn_of_the_gpu_memory(Settings(workers=fits, device="cuda"), total)
            assert not caplog.records
        _warn_of_the_gpu_memory(Settings(workers=fits + 1, device="cuda"), total)
    assert "workers may fail to start" in caplog.text, caplog.text


def test_the_timed_choice_on_cuda(repository):
    """The warm-up's timing (the service's default; 1 s a model here) on CUDA: the book's tiny additive request
    runs on a CPU session beside CUDA (small runs cost less there, and the shared GPU nothing), a long
    outputs-only dot_product request (1 x 16384 x 16384 x 64) on CUDA's fused graph, its device cost linear;
    both answer the CPU's numbers. `-s` prints each model's ladder and times."""
    import json

    import onnxruntime as ort
    import orjson

    from service.core.choice import describe_ladders
    from service.core.cost import device_run
    from service.core.jobs import Job
    from service.core.merge import run_batch
    from service.core.metrics import Metrics
    from service.core.request import Request
    from service.http.schemas import toy_request
    from service.protocols.attend import decode_body, encode_attend

    if CUDA not in ort.get_available_providers():
        pytest.skip("no CUDA execution provider in this onnxruntime (onnxruntime-gpu is needed)")
    try:
        registry = Registry.load(repository, "cuda", 1, graph_timing_s=1.0)
    except Exception as e:  # as cuda_registry: the load says why CUDA cannot be used
        pytest.skip(f"CUDA cannot be used here: {e}")
    for name in registry.names():
        model = registry.get(name)
        print(f"{name}: {describe_ladders(model.choice)}")
        for row in model.timings.describe() if model.timings else []:
            print("   ", row)
    additive = registry.get("additive")
    assert [(g.file, g.provider) for g in additive.graphs] == [("1/model.onnx", CUDA), ("1/model.onnx", CPU)]
    job = Job(decode_body(json.dumps(toy_request()).encode(), registry), float("inf"), encode=encode_attend)
    graph = additive.graph_for(True, job.elements)
    assert graph.provider == CPU, describe_ladders(additive.choice)
    results, _ = run_batch(additive, [job], Metrics())
    assert graph.runs == 1
    np.testing.assert_allclose(orjson.loads(results[0])["outputs"], [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)

    model = registry.get("dot_product")
    n, d, length = 16384, 64, 16000
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal((1, n, d), dtype=np.float32) for name in ("queries", "keys", "values")}
    feed["valid_lens"] = np.full((1, n), length, np.int64)
    job = Job(Request(model, feed, False), float("inf"), encode=encode_attend)
    graph = model.graph_for(False, job.elements)
    assert (graph.file, graph.provider) == ("1/model.cuda.outputs.onnx", CUDA), describe_ladders(model.choice)
    assert job.device == device_run(3 * n * d + n, n * d + n * n, n * n, 0, False)  # no score matrix
    results, _ = run_batch(model, [job], Metrics())
    assert graph.runs == 1
    got = np.asarray(orjson.loads(results[0])["outputs"])[0, :4]
    q, k, v = (feed[name][0].astype(np.float64) for name in ("queries", "keys", "values"))
    scores = q[:4] @ k[:length].T / np.sqrt(d)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = (weights / weights.sum(axis=1, keepdims=True)) @ v[:length]
    np.testing.assert_allclose(got, want, rtol=FUSED_TOLERANCE, atol=FUSED_TOLERANCE)


def test_scores_past_32_bit_indexes_are_refused_before_they_run(cuda_registry, repository):
    """On a lent H200, model.onnx's Softmax at n = 65536 (2^32 scores) ended in CUDA's illegal memory access,
    which leaves the process's CUDA context unusable: such a run is a 413 before it runs, and the same request
    without weights runs on the fused kernel."""
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.http.app import create_app

    n = 46341  # n * n just past 2^31
    body = {"model": "dot_product", "queries": [[[0.5]] * n], "keys": [[[0.25]] * n], "values": [[[1.0]] * n],
            "valid_lens": [n]}
    settings = Settings(model_repository=repository, device="cuda", intra_op_threads=1, max_sequence=n,
                        max_weight_elements=1 << 32, max_device_bytes=1 << 40, max_inflight_bytes=1 << 40)
    with TestClient(create_app(settings)) as client:
        refused = client.post("/attend", json=body)
        assert refused.status_code == 413 and "2^31" in refused.json()["error"]["message"], refused.text
        served = client.post("/attend", json=body | {"return_weights": False})
        assert served.status_code == 200, served.text
        assert np.allclose(np.asarray(served.json()["outputs"]), 1.0)


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize("form", ["1d", "2d"])
def test_the_fp16_graph_runs_flash_to_fp16s_precision(cuda_registry, kind, form, tmp_path):
    """bench/longseq.py's fp16 graph (export.fused, `half`), built here from a seeded module beside its fp32
    CUDA graph: lengths one an example run Flash attention (fp16, no mask), one a query not (Flash takes no
    mask); the outputs are the fp32 graph's (on the CPU) within HALF_TOLERANCE, rows of valid length 0 zeros."""
    import onnx
    import onnxruntime as ort
    import torch

    from export.build import build_module
    from export.fused import HALF_TOLERANCE, fused_graph

    hp = cuda_registry.get(kind).config.hyperparameters
    torch.manual_seed(0)
    module = build_module(kind, hp)
    path = tmp_path / "half.onnx"
    onnx.save(fused_graph(kind, module, hp, weights=False, cuda=True, half=True), str(path))
    fp32 = ort.InferenceSession(fused_graph(kind, module, hp, weights=False, cuda=True).SerializeToString(),
                                providers=[CPU])
    feed = example_feed(kind, hp, FUSED_SIZES[2], np.random.default_rng(4))
    lens = _lengths(feed, form)
    kernels = _kernels(path, feed)
    assert kernels == ["Flash"] if form == "1d" else "Flash" not in kernels, kernels
    (got,) = ort.InferenceSession(str(path), providers=[(CUDA, {"use_tf32": "0"})]).run(["outputs"], feed)
    (want,) = fp32.run(["outputs"], feed)
    np.testing.assert_allclose(got, want, rtol=HALF_TOLERANCE, atol=HALF_TOLERANCE)
    assert (lens == 0).any() and not got[lens == 0].any()
