"""The CPU graph (config.json's variants["cpu"], model.cpu.onnx) in the service: served where the CPU
execution provider runs the model, said by GET /models/{name}, the oracle's numbers through HTTP for
1-D and 2-D valid lengths (0 and full among them), checked at load as model.onnx is (a broken one is
refused with its reason), loaded again with a new version; a repository without variants still serves.
Its twin without the weights (variants["cpu_outputs"], model.cpu.outputs.onnx) answers what returns no
weights, with the same outputs, and is checked at load as the others; so is CUDA's graph without them
(variants["cuda_outputs"], model.cuda.outputs.onnx), which the CPU does not serve but runs, to the CPU
graph's numbers."""

import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from export.build import build_module
from export.cli import main as export
from export.repository import default_hyperparameters, example_feed, sha256_of
from service.core.runtime import CPU, Registry, StartupError
from tests.models import oracle
from tests.server import running_service

pytestmark = pytest.mark.slow

FUSED = ("dot_product", "multi_head", "self_attention")
ADMIN = {"Authorization": "Bearer admin-key-1"}


@pytest.fixture
def repo(repository, tmp_path):
    """The default repository, less the kinds without a CPU graph but additive (quicker to start)."""
    path = shutil.copytree(repository, tmp_path / "repo")
    for name in ("masked_softmax", "positional_encoding"):
        shutil.rmtree(path / name)
    return path


def _config(repo, name, version=None):
    folder = repo / name if version is None else repo / name / str(version)
    return json.loads((folder / "config.json").read_text())


def _write_config(repo, name, config):
    for path in (repo / name / "config.json", repo / name / "1" / "config.json"):
        path.write_text(json.dumps(config))


def _lens(form, batch, n_q, n_k, rng):
    lens = rng.integers(0, n_k + 1, size=(batch,) if form == "1d" else (batch, n_q))  # the service takes 0..n_k
    flat = lens.reshape(-1)
    flat[0], flat[-1] = 0, n_k  # attends to nothing, and to every key
    return lens


def _post(url, body):
    response = httpx.post(f"{url}/attend", json=body, timeout=30)
    assert response.status_code == 200, response.text
    outputs, weights = np.array(response.json()["outputs"]), np.array(response.json()["attention_weights"])
    # The same request without the weights (the graph without them): the same outputs, to the bit.
    response = httpx.post(f"{url}/attend", json={**body, "return_weights": False}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["attention_weights"] is None
    np.testing.assert_array_equal(np.array(response.json()["outputs"]), outputs)
    return outputs, weights


def test_the_service_serves_the_cpu_graph_with_the_oracles_numbers(repo):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)  # the exporter's default seed: the served weights
    mha = build_module("multi_head", default_hyperparameters("multi_head"))
    W = [getattr(mha, name).weight.detach().double().numpy() for name in ("W_q", "W_k", "W_v", "W_o")]
    # The fixed choice (ATTEND_GRAPH_TIMING_S=0): the CPU graph for every size, its twin for no weights (the
    # timed choice has its own tests: tests/service/test_graph_choice.py).
    with running_service(repo, ATTEND_GRAPH_TIMING_S="0") as (url, _):
        for name in ("additive", *FUSED):
            described = httpx.get(f"{url}/models/{name}", timeout=10).json()
            config = _config(repo, name)
            assert described["provider"] == CPU
            if name == "additive":  # no CPU graph: model.onnx
                assert (described["model_file"], described["sha256"]) == ("1/model.onnx", config["sha256"])
                assert described["model_file_without_weights"] is None
            else:
                assert described["model_file"] == "1/model.cpu.onnx" and described["opset"] == 24
                assert described["model_file_without_weights"] == "1/model.cpu.outputs.onnx"
                assert described["sha256"] == config["variants"]["cpu"]["sha256"] == \
                    sha256_of(repo / name / "1" / "model.cpu.onnx")
        for form in ("1d", "2d"):
            batch, n_q, n_k = 3, 7, 19
            Q = rng.standard_normal((batch, n_q, 6)).astype(np.float32)
            K = rng.standard_normal((batch, n_k, 6)).astype(np.float32)
            V = rng.standard_normal((batch, n_k, 4)).astype(np.float32)
            lens = _lens(form, batch, n_q, n_k, rng)
            body = {"model": "dot_product", "queries": Q.tolist(), "keys": K.tolist(), "values": V.tolist(),
                    "valid_lens": lens.tolist()}
            out, weights = _post(url, body)
            want_out, want_w = oracle.dot_product(*(a.astype(np.float64) for a in (Q, K, V)), lens)
            np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-5)
            assert np.all(out[0, 0] == 0) and np.all(weights[0, 0] == 0)  # length 0: zeros, as the oracle

            Q, K, V = (rng.standard_normal((2, n, 100)).astype(np.float32) for n in (5, 11, 11))
            lens = _lens(form, 2, 5, 11, rng)
            body = {"model": "multi_head", "queries": Q.tolist(), "keys": K.tolist(), "values": V.tolist(),
                    "valid_lens": lens.tolist()}
            out, weights = _post(url, body)
            want_out, want_w = oracle.multi_head(*W, 5, *(a.astype(np.float64) for a in (Q, K, V)), lens)
            np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-5)

            X = rng.standard_normal((2, 9, 100)).astype(np.float32)
            lens = _lens(form, 2, 9, 9, rng)
            out, weights = _post(url, {"model": "self_attention", "queries": X.tolist(), "valid_lens": lens.tolist()})
            torch.manual_seed(0)
            module = build_module("self_attention", default_hyperparameters("self_attention"))
            with torch.no_grad():
                want_out, want_w = module(torch.from_numpy(X), torch.from_numpy(lens))
            np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(weights, want_w.numpy(), rtol=1e-5, atol=1e-5)


def _variant_wrong_sha(repo):
    path = repo / "dot_product" / "1" / "model.cpu.onnx"
    path.write_bytes(path.read_bytes() + b"\x00")


def _variant_corrupt(repo):
    path = repo / "dot_product" / "1" / "model.cpu.onnx"
    path.write_bytes(b"\x08\x07garbage" * 100)
    config = _config(repo, "dot_product")
    config["variants"]["cpu"]["sha256"] = sha256_of(path)  # the hash fits: the file is just bad
    _write_config(repo, "dot_product", config)


def _swap_in(repo, variant, source):
    """`source`, a valid graph, in the place of dot_product's `variant`, config.json naming its hash."""
    config = _config(repo, "dot_product")
    path = repo / "dot_product" / config["variants"][variant]["file"]
    shutil.copy(source, path)
    config["variants"][variant]["sha256"] = sha256_of(path)
    _write_config(repo, "dot_product", config)


def _variant_of_another_signature(repo):
    # additive's model.onnx, a valid graph with a fitting hash, in dot_product's place: other inputs
    _swap_in(repo, "cpu", repo / "additive" / "1" / "model.onnx")


def _variant_missing(repo):
    (repo / "dot_product" / "1" / "model.cpu.onnx").unlink()


def _variant_malformed(repo):
    config = _config(repo, "dot_product")
    del config["variants"]["cpu"]["sha256"]
    _write_config(repo, "dot_product", config)


def _outputs_graph_wrong_sha(repo):
    path = repo / "dot_product" / "1" / "model.cpu.outputs.onnx"
    path.write_bytes(path.read_bytes() + b"\x00")


def _outputs_graph_with_the_weights(repo):
    # model.cpu.onnx in its place, with a fitting hash: one output too many
    _swap_in(repo, "cpu_outputs", repo / "dot_product" / "1" / "model.cpu.onnx")


def _outputs_graph_missing(repo):
    (repo / "dot_product" / "1" / "model.cpu.outputs.onnx").unlink()


def _cuda_graph_wrong_sha(repo):
    # Not served on the CPU, but a version is served whole or not at all.
    path = repo / "dot_product" / "1" / "model.cuda.outputs.onnx"
    path.write_bytes(path.read_bytes() + b"\x00")


def _cuda_graph_missing(repo):
    (repo / "dot_product" / "1" / "model.cuda.outputs.onnx").unlink()


def _cuda_graph_malformed(repo):
    config = _config(repo, "dot_product")
    config["variants"]["cuda_outputs"]["opset"] = "24"
    _write_config(repo, "dot_product", config)


def _unused_model_onnx_wrong_sha(repo):
    # On the CPU model.onnx is not served, but a version is served whole or not at all.
    path = repo / "dot_product" / "1" / "model.onnx"
    path.write_bytes(path.read_bytes() + b"\x00")


BREAKAGES = [
    (_variant_wrong_sha, "model dot_product: sha256 of dot_product/1/model.cpu.onnx is [0-9a-f]{64}, config.json says"),
    (_variant_corrupt, "model dot_product: ONNX Runtime cannot load dot_product/1/model.cpu.onnx"),
    (_variant_of_another_signature, "model dot_product: the graph's inputs/outputs"),
    (_variant_missing, "model dot_product: dot_product/1/model.cpu.onnx is missing"),
    (_variant_malformed, r"model dot_product: unreadable config.json: variants\[\"cpu\"\] must be"),
    (_unused_model_onnx_wrong_sha, "model dot_product: sha256 of dot_product/1/model.onnx is"),
    (_outputs_graph_wrong_sha, "model dot_product: sha256 of dot_product/1/model.cpu.outputs.onnx is [0-9a-f]{64}, "),
    (_outputs_graph_with_the_weights, r"model dot_product: the graph's inputs/outputs .*'attention_weights'.* do not"),
    (_outputs_graph_missing, "model dot_product: dot_product/1/model.cpu.outputs.onnx is missing"),
    (_cuda_graph_wrong_sha, "model dot_product: sha256 of dot_product/1/model.cuda.outputs.onnx is [0-9a-f]{64}, "),
    (_cuda_graph_missing, "model dot_product: dot_product/1/model.cuda.outputs.onnx is missing"),
    (_cuda_graph_malformed, r"model dot_product: unreadable config.json: variants\[\"cuda_outputs\"\] must be"),
]


@pytest.mark.parametrize("breakage, reason", BREAKAGES, ids=[b[0].__name__ for b in BREAKAGES])
def test_a_broken_cpu_graph_stops_the_load_with_the_reason(repo, breakage, reason):
    breakage(repo)
    with pytest.raises(StartupError, match=reason) as raised:
        Registry.load(repo, "cpu", 1)
    assert str(repo) not in str(raised.value)
    skipped = Registry.load(repo, "cpu", 1, skip_broken=True)
    assert "dot_product" in skipped.broken and skipped.get("multi_head").model_file == "1/model.cpu.onnx"


def test_a_repository_without_variants_serves_model_onnx(repo):
    for name in FUSED:
        config = _config(repo, name)
        del config["variants"]  # as written before there were variants
        _write_config(repo, name, config)
    registry = Registry.load(repo, "cpu", 1)
    for name in FUSED:
        model = registry.get(name)
        assert model.describe()["model_file"] == "1/model.onnx" and model.config.variants == {}
        assert model.describe()["model_file_without_weights"] is None
        assert model.describe()["sha256"] == _config(repo, name)["sha256"]
    feed = {"queries": np.ones((1, 2, 3), np.float32), "keys": np.ones((1, 4, 3), np.float32),
            "values": np.arange(8, dtype=np.float32).reshape(1, 4, 2), "valid_lens": np.array([[2, 0]])}
    out = registry.get("dot_product").run(feed)
    np.testing.assert_allclose(out["outputs"], [[[1, 2], [0, 0]]], rtol=1e-6)


def test_auto_serves_the_graph_of_the_provider_that_runs(repo):
    """ATTEND_DEVICE=auto: with a GPU, CUDA runs model.onnx; without one (ONNX Runtime falls back to the CPU),
    the CPU runs its own graph."""
    registry = Registry.load(repo, "auto", 1)
    for name in FUSED:
        model = registry.get(name)
        expected = "1/model.cpu.onnx" if model.provider == CPU else "1/model.onnx"
        assert model.model_file == expected and model.session.get_providers()[0] == model.provider


def test_a_new_version_loads_with_its_cpu_graph_and_a_broken_one_is_refused(repo):
    Q = np.random.default_rng(1).normal(size=(2, 3, 100)).round(3).tolist()
    body = {"model": "multi_head", "queries": Q, "keys": Q, "values": Q, "valid_lens": [[0, 2, 3], [3, 1, 0]]}
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1", ATTEND_GRAPH_TIMING_S="0") as (url, _):
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0
        response = httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60)
        assert response.status_code == 200, response.text
        described = httpx.get(f"{url}/models/multi_head", timeout=10).json()
        assert (described["version"], described["model_file"]) == (2, "2/model.cpu.onnx")
        out, weights = _post(url, body)
        torch.manual_seed(7)
        module = build_module("multi_head", default_hyperparameters("multi_head"))
        with torch.no_grad():
            X = torch.tensor(Q, dtype=torch.float32)
            want_out, want_w = module(X, X, X, torch.tensor(body["valid_lens"]))
        np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(weights, want_w.numpy(), rtol=1e-5, atol=1e-5)

        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "8"]) == 0
        (repo / "multi_head" / "3" / "model.cpu.onnx").write_bytes(b"\x08\x07 not a model")
        response = httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"].startswith("model multi_head: sha256 of multi_head/3/model.cpu.onnx is ")
        described = httpx.get(f"{url}/models/multi_head", timeout=10).json()
        assert (described["version"], described["model_file"]) == (2, "2/model.cpu.onnx")  # 2 keeps serving
        np.testing.assert_allclose(_post(url, body)[0], out, rtol=0, atol=0)


def test_a_batch_without_weights_runs_the_graph_without_them(repo):
    """LoadedModel.run(feed, weights=False): the session of model.cpu.outputs.onnx, which has no
    attention_weights, gives the CPU graph's outputs to the bit, lengths per example and per query; a
    model without that graph (additive; a version from before it) runs its one graph, without fetching the
    weights."""
    registry = Registry.load(repo, "cpu", 1)
    rng = np.random.default_rng(4)
    for name in FUSED:
        model = registry.get(name)
        outputs = [o.name for o in model.session_without_weights.get_outputs()]
        assert outputs == ["outputs"] and model.describe()["model_file"] == "1/model.cpu.onnx"
        f = 6 if name == "dot_product" else 100
        for lens in (np.array([[2] * 5, [0] * 5, [7] * 5]), np.array([[2, 3, 0, 7, 1], [0] * 5, [7] * 5])):
            feed = {"queries": rng.standard_normal((3, 5, f), dtype=np.float32), "valid_lens": lens}
            if name != "self_attention":
                n_k = 7
                feed["keys"] = rng.standard_normal((3, n_k, f), dtype=np.float32)
                feed["values"] = rng.standard_normal((3, n_k, 4 if name == "dot_product" else f), dtype=np.float32)
            else:
                feed["valid_lens"] = np.minimum(lens, 5)
            whole, alone = model.run(feed), model.run(feed, weights=False)
            assert set(whole) == {"outputs", "attention_weights"} and set(alone) == {"outputs"}
            np.testing.assert_array_equal(alone["outputs"], whole["outputs"])
    assert registry.get("additive").session_without_weights is None
    additive = registry.get("additive")  # its one graph runs, and its weights are not fetched
    assert set(additive.run(example_feed("additive", default_hyperparameters("additive"), {
        "batch": 1, "n_q": 2, "n_k": 3, "d": 4, "value_size": 5}, rng), weights=False)) == {"outputs"}
    assert [g.file for g in additive.graphs] == ["1/model.onnx"]
    config = _config(repo, "dot_product")
    del config["variants"]["cpu_outputs"]  # as exported before it
    _write_config(repo, "dot_product", config)
    assert Registry.load(repo, "cpu", 1).get("dot_product").session_without_weights is None


def test_the_cuda_graph_on_the_cpu_gives_the_served_graphs_outputs(repo):
    """model.cuda.outputs.onnx, on the CPU execution provider (where ONNX Runtime runs it too), as a CUDA
    session runs it beside model.onnx: the outputs of the graph the CPU serves for the same batch, lengths
    per example and per query, rows of valid length 0 zeros; its signature is config.json's but the weights."""
    import onnxruntime as ort

    from service.core.runtime import check_signature

    registry = Registry.load(repo, "cpu", 1)
    rng = np.random.default_rng(9)
    for name in FUSED:
        model = registry.get(name)
        assert model.model_file_without_weights == "1/model.cpu.outputs.onnx"
        cuda_file = model.config.graph_without_weights(cpu=False)[0]
        assert cuda_file == "1/model.cuda.outputs.onnx" and model.config.variants["cuda_outputs"]["sha256"] == \
            sha256_of(repo / name / cuda_file)
        session = ort.InferenceSession(str(repo / name / cuda_file), providers=[CPU])
        check_signature(model, session)  # what the load checks on CUDA
        f = 6 if name == "dot_product" else 100
        for lens in (np.array([[2] * 5, [0] * 5, [7] * 5]), np.array([[2, 3, 0, 7, 1], [0] * 5, [7] * 5])):
            feed = {"queries": rng.standard_normal((3, 5, f), dtype=np.float32), "valid_lens": lens}
            if name != "self_attention":
                feed["keys"] = rng.standard_normal((3, 7, f), dtype=np.float32)
                feed["values"] = rng.standard_normal((3, 7, 4 if name == "dot_product" else f), dtype=np.float32)
            else:
                feed["valid_lens"] = np.minimum(lens, 5)
            (got,) = session.run(["outputs"], feed)
            np.testing.assert_allclose(got, model.run(feed, weights=False)["outputs"], rtol=1e-5, atol=1e-6)
            assert np.all(got[feed["valid_lens"] == 0] == 0)
