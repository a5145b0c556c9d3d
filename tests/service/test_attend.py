"""POST /attend: the contract, and the numbers against the PyTorch modules."""

import numpy as np
import pytest
import torch

from export.build import build_module
from export.repository import default_hyperparameters
from service.schemas import toy_request


def _post(client, body):
    response = client.post("/attend", json=body)
    assert response.headers["content-type"] == "application/json"
    return response


def test_the_books_toy_additive_example(client):
    response = _post(client, toy_request())
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == "additive"
    np.testing.assert_allclose(body["outputs"], [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)
    np.testing.assert_allclose(body["attention_weights"],
                               [[[0.5] * 2 + [0] * 8], [[1 / 6] * 6 + [0] * 4]], rtol=1e-6)


def test_the_books_toy_dot_product_example(client):
    body = toy_request()
    body.update(model="dot_product", queries=np.random.default_rng(1).normal(size=(2, 1, 2)).tolist())
    response = _post(client, body)
    assert response.status_code == 200
    np.testing.assert_allclose(response.json()["outputs"], [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)


def test_dot_product_is_the_default_model(client):
    body = toy_request()
    del body["model"]
    body["queries"] = [[[1.0, 0.0]], [[0.0, 1.0]]]
    assert _post(client, body).json()["model"] == "dot_product"


def test_the_books_multi_head_example(client):
    X = np.ones((2, 4, 100)).tolist()
    body = _post(client, {"model": "multi_head", "queries": X, "keys": X, "values": X, "valid_lens": [3, 2]}).json()
    assert np.array(body["outputs"]).shape == (2, 4, 100)
    weights = np.array(body["attention_weights"])
    assert weights.shape == (2, 5, 4, 4)
    assert np.all(weights[0, :, :, 3:] == 0) and np.all(weights[1, :, :, 2:] == 0)


def test_self_attention_takes_only_queries(client):
    X = np.random.default_rng(0).normal(size=(2, 6, 100)).tolist()
    body = _post(client, {"model": "self_attention", "queries": X, "valid_lens": [[6] * 6, [2] * 6]}).json()
    assert np.array(body["outputs"]).shape == (2, 6, 100)
    assert np.array(body["attention_weights"]).shape == (2, 5, 6, 6)


def test_return_weights_false_leaves_them_out(client):
    body = toy_request() | {"return_weights": False}
    response = _post(client, body).json()
    assert response["attention_weights"] is None
    assert np.array(response["outputs"]).shape == (2, 1, 4)


def test_valid_length_zero_gives_zero_rows(client):
    body = toy_request() | {"valid_lens": [[0], [10]]}
    response = _post(client, body).json()
    assert response["outputs"][0] == [[0.0, 0.0, 0.0, 0.0]]
    assert response["attention_weights"][0] == [[0.0] * 10]


# --- the same numbers as the PyTorch modules, for every valid-lengths form -------------------

_MODULES: dict[str, torch.nn.Module] = {}


def _module(kind):
    if kind not in _MODULES:
        torch.manual_seed(0)  # the exporter's default seed
        _MODULES[kind] = build_module(kind, default_hyperparameters(kind))
    return _MODULES[kind]


def _inputs(kind, batch, n_q, n_k, rng):
    hp = default_hyperparameters(kind)
    if kind == "dot_product":
        return [rng.normal(size=(batch, n_q, 5)), rng.normal(size=(batch, n_k, 5)), rng.normal(size=(batch, n_k, 3))]
    if kind == "additive":
        return [rng.normal(size=(batch, n_q, 20)), rng.normal(size=(batch, n_k, 2)), rng.normal(size=(batch, n_k, 6))]
    if kind == "multi_head":
        return [rng.normal(size=(batch, n, hp["key_size"])) for n in (n_q, n_k, n_k)]
    return [rng.normal(size=(batch, n_q, hp["num_hiddens"]))]


@pytest.mark.parametrize("kind", ["dot_product", "additive", "multi_head", "self_attention"])
@pytest.mark.parametrize("lens_form", ["absent", "null", "1d", "2d"])
@pytest.mark.parametrize("batch, n_q, n_k", [(1, 1, 1), (3, 2, 5), (2, 7, 4)])
def test_numbers_match_the_pytorch_module(client, kind, lens_form, batch, n_q, n_k):
    rng = np.random.default_rng(batch * 100 + n_q * 10 + n_k)
    if kind == "self_attention":
        n_k = n_q
    arrays = [a.astype(np.float32) for a in _inputs(kind, batch, n_q, n_k, rng)]
    lens = None
    if lens_form == "1d":
        lens = rng.integers(0, n_k + 1, size=batch)
    elif lens_form == "2d":
        lens = rng.integers(0, n_k + 1, size=(batch, n_q))
    body = {"model": kind, "queries": arrays[0].tolist()}
    if kind != "self_attention":
        body |= {"keys": arrays[1].tolist(), "values": arrays[2].tolist()}
    if lens_form != "absent":
        body["valid_lens"] = None if lens is None else lens.tolist()
    response = _post(client, body)
    assert response.status_code == 200, response.text
    with torch.no_grad():
        out, weights = _module(kind)(*map(torch.from_numpy, arrays),
                                     None if lens is None else torch.from_numpy(lens))
    got = response.json()
    np.testing.assert_allclose(got["outputs"], out.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["attention_weights"], weights.numpy(), rtol=1e-5, atol=1e-5)
