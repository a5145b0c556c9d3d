"""POST /attend: the contract, and the numbers against the PyTorch modules."""

import numpy as np
import pytest
import torch

from export.build import build_module
from export.repository import default_hyperparameters
from service.http.schemas import toy_request


@pytest.fixture
def client(served):
    """Every test of this module against each server (tests/service/conftest.py's SERVERS)."""
    return served


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


# --- the chapters' last two functions, each served on its own ---------------------------------

def test_masked_softmax_the_books_examples(client):
    """The chapter's masked_softmax(rand(2, 2, 4), [2, 3]) and (..., [[1, 3], [2, 4]]): weights past a
    valid length are exactly 0, each row is the softmax of its valid prefix (the oracle's formula)."""
    from tests.models.oracle import softmax_valid

    scores = np.random.default_rng(5).random((2, 2, 4))
    for lens in ([2, 3], [[1, 3], [2, 4]]):
        body = _post(client, {"model": "masked_softmax", "scores": scores.tolist(), "valid_lens": lens}).json()
        weights = np.array(body["attention_weights"])
        assert weights.shape == (2, 2, 4) and body["outputs"] == body["attention_weights"]
        for b in range(2):
            for i in range(2):
                n = lens[b] if isinstance(lens[b], int) else lens[b][i]
                np.testing.assert_allclose(weights[b, i], softmax_valid(scores[b, i], n), rtol=1e-6, atol=1e-7)
                assert np.all(weights[b, i, n:] == 0)
    # The printed example's first row, length 1: all the weight on the first key.
    assert body["attention_weights"][0][0] == [1.0, 0.0, 0.0, 0.0]


def test_masked_softmax_without_lengths_is_softmax(client):
    scores = np.random.default_rng(6).normal(size=(3, 2, 5))
    body = _post(client, {"model": "masked_softmax", "scores": scores.tolist()}).json()
    expected = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(body["attention_weights"], expected, rtol=1e-6)


def test_positional_encoding_the_chapters_figure(client):
    """60 positions x 32 dimensions of zeros: outputs and P are the chapter's P; columns 6 to 9 are
    the curves of its figure: sin and cos of i / 10000^(6/32), then of i / 10000^(8/32)."""
    from tests.models.oracle import positional_encoding

    body = _post(client, {"model": "positional_encoding", "queries": np.zeros((1, 60, 32)).tolist()}).json()
    P = np.array(body["P"])
    assert P.shape == (60, 32) and body["attention_weights"] is None
    np.testing.assert_allclose(body["outputs"], [P], rtol=0, atol=0)
    np.testing.assert_allclose(P, positional_encoding(60, 32), atol=1e-6)
    i = np.arange(60)
    for column, (f, j) in zip(range(6, 10), [(np.sin, 6), (np.cos, 6), (np.sin, 8), (np.cos, 8)], strict=True):
        np.testing.assert_allclose(P[:, column], f(i / 10000 ** (j / 32)), atol=1e-6)
    assert P[0, 0::2].tolist() == [0.0] * 16 and P[0, 1::2].tolist() == [1.0] * 16  # position 0


def test_positional_encoding_adds_p_to_any_even_size(client):
    from tests.models.oracle import positional_encoding

    X = np.random.default_rng(7).normal(size=(2, 7, 10))
    body = _post(client, {"model": "positional_encoding", "queries": X.tolist()}).json()
    np.testing.assert_allclose(body["outputs"], X + positional_encoding(7, 10), atol=2e-6)


@pytest.mark.parametrize("body, field, words", [
    ({"model": "positional_encoding", "queries": np.zeros((1, 3, 5)).tolist()}, "queries", "even feature size"),
    ({"model": "positional_encoding", "queries": np.zeros((1, 1001, 2)).tolist()}, "queries", "max_len 1000"),
    ({"model": "positional_encoding", "queries": np.zeros((1, 3, 4)).tolist(), "valid_lens": [2]}, "valid_lens",
     "takes no valid_lens"),
    ({"model": "masked_softmax", "queries": np.zeros((1, 3, 4)).tolist()}, "queries",
     "takes no queries: it takes the scores"),
    ({"model": "masked_softmax", "valid_lens": [1]}, "scores", "scores is required"),
    ({"model": "masked_softmax", "scores": np.zeros((1, 3, 4)).tolist(), "keys": [[[1.0]]]}, "keys",
     "takes no keys: it takes the scores"),
    ({"model": "masked_softmax", "scores": np.zeros((1, 3, 4)).tolist(), "valid_lens": [5]}, "valid_lens",
     "between 0 and n_k = 4"),
])
def test_the_new_kinds_refuse_what_they_do_not_take(client, body, field, words):
    response = client.post("/attend", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field and words in response.json()["error"]["message"]
