"""Every bad input gets a clear 4xx in the one error body shape, naming the field (and for shapes
the expected and received ones); none disturbs the service or concurrent requests."""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.http.schemas import toy_request

TOY = toy_request()  # additive: queries (2, 1, 20), keys (2, 10, 2), values (2, 10, 4), valid_lens [2, 6]


@pytest.fixture
def client(served):
    """Every test of this module against each server (tests/service/conftest.py's SERVERS)."""
    return served


def toy(**changes):
    body = dict(TOY)
    for key, value in changes.items():
        if value is DROP:
            body.pop(key)
        else:
            body[key] = value
    return body


DROP = object()
Q20 = TOY["queries"]
K = TOY["keys"]
V = TOY["values"]


def dot(**changes):
    return toy(model="dot_product", queries=[[[0.5, 0.5]], [[1.0, -1.0]]], **changes)


def seq(n, d=100):
    return np.zeros((1, n, d)).tolist()


# (id, body (dict -> JSON, bytes -> raw), status, code, field, expected, received)
# The message of many is checked word for word in MESSAGES below.
CASES = [
    ("not-json", b"{not json", 400, "invalid_json", None, None, None),
    ("empty-body", b"", 400, "invalid_json", None, None, None),
    ("json-array", b"[1, 2]", 400, "invalid_json", None, None, None),
    ("nan-token", b'{"queries": [[[NaN]]]}', 400, "invalid_json", None, None, None),
    ("infinity-token", b'{"queries": [[[Infinity]]]}', 400, "invalid_json", None, None, None),
    ("unknown-model", toy(model="nope"), 404, "model_not_found", "model", None, None),
    ("model-not-string", toy(model=3), 422, "invalid_request", "model", None, None),
    ("unknown-field", toy(valid_len=[1, 2]), 422, "invalid_request", "valid_len", None, None),
    ("queries-string", toy(queries="1,2,3"), 422, "invalid_request", "queries", None, None),
    ("queries-number", toy(queries=1.5), 422, "invalid_request", "queries", None, None),
    ("strings-in-queries", toy(queries=[[["a"] * 20]] * 2), 422, "invalid_request", "queries", None, None),
    ("booleans-in-keys", toy(keys=[[[True, False]] * 10] * 2), 422, "invalid_request", "keys", None, None),
    ("null-in-values", toy(values=[[[None] * 4] * 10] * 2), 422, "invalid_request", "values", None, None),
    ("ragged-queries", toy(queries=[[[0.0] * 20], [[0.0] * 19]]), 422, "invalid_shape", "queries", None, None),
    ("ragged-depth", toy(keys=[[[1.0, 1.0]] * 10, [1.0] * 10]), 422, "invalid_shape", "keys", None, None),
    ("queries-2d", toy(queries=[[0.0] * 20] * 2), 422, "invalid_shape", "queries", ["batch", "n_q", 20], [2, 20]),
    ("keys-4d", toy(keys=[K]), 422, "invalid_shape", "keys", ["batch", "n_k", 2], [1, 2, 10, 2]),
    ("queries-empty", toy(queries=[]), 422, "invalid_shape", "queries", ["batch", "n_q", 20], [0]),
    ("keys-empty-rows", toy(keys=[[], []]), 422, "invalid_shape", "keys", ["batch", "n_k", 2], [2, 0]),
    ("values-empty-features", toy(values=[[[]] * 10] * 2), 422, "invalid_shape", "values",
     ["batch", "n_k", "value_size"], [2, 10, 0]),
    ("missing-keys", toy(keys=DROP), 422, "invalid_request", "keys", ["batch", "n_k", 2], None),
    ("missing-queries", toy(queries=DROP), 422, "invalid_request", "queries", ["batch", "n_q", 20], None),
    ("batch-keys", toy(keys=K + K[:1]), 422, "invalid_shape", "keys", [2, "n_k", 2], [3, 10, 2]),
    ("batch-values", toy(values=V[:1]), 422, "invalid_shape", "values", [2, 10, "value_size"], [1, 10, 4]),
    ("n_k-values", toy(values=[v[:9] for v in V]), 422, "invalid_shape", "values", [2, 10, "value_size"], [2, 9, 4]),
    ("query-size", toy(queries=[[[0.0] * 19]] * 2), 422, "invalid_shape", "queries", ["batch", "n_q", 20],
     [2, 1, 19]),
    ("key-size", toy(keys=[[[1.0] * 3] * 10] * 2), 422, "invalid_shape", "keys", [2, "n_k", 2], [2, 10, 3]),
    ("dot-d-mismatch", dot(keys=[[[1.0] * 3] * 10] * 2), 422, "invalid_shape", "keys", [2, "n_k", 2], [2, 10, 3]),
    ("lens-negative", toy(valid_lens=[-1, 2]), 422, "invalid_request", "valid_lens", "0 <= valid_len <= 10", -1),
    ("lens-int64-min", toy(valid_lens=[-2**63, 2]), 422, "invalid_request", "valid_lens", "0 <= valid_len <= 10",
     -2**63),
    ("lens-above-n_k", toy(valid_lens=[2, 11]), 422, "invalid_request", "valid_lens", "0 <= valid_len <= 10", 11),
    ("lens-2d-above-n_k", toy(valid_lens=[[2], [99]]), 422, "invalid_request", "valid_lens",
     "0 <= valid_len <= 10", 99),
    ("lens-fraction", toy(valid_lens=[2.5, 3]), 422, "invalid_request", "valid_lens", None, None),
    ("lens-string", toy(valid_lens="2,6"), 422, "invalid_request", "valid_lens", None, None),
    ("lens-strings", toy(valid_lens=["2", "6"]), 422, "invalid_request", "valid_lens", None, None),
    ("lens-batch", toy(valid_lens=[2, 6, 1]), 422, "invalid_shape", "valid_lens",
     "null, [batch] = [2] or [batch, n_q] = [2, 1]", [3]),
    ("lens-n_q", toy(valid_lens=[[2, 2], [6, 6]]), 422, "invalid_shape", "valid_lens",
     "null, [batch] = [2] or [batch, n_q] = [2, 1]", [2, 2]),
    ("lens-3d", toy(valid_lens=[[[2]], [[6]]]), 422, "invalid_shape", "valid_lens",
     "null, [batch] = [2] or [batch, n_q] = [2, 1]", [2, 1, 1]),
    ("not-finite-float32", toy(values=[[[1e39] * 4] * 10] * 2), 422, "invalid_request", "values", None, None),
    ("not-finite-int", toy(keys=[[[10**40, 1]] * 10] * 2), 422, "invalid_request", "keys", None, None),
    ("return-weights-string", toy(return_weights="yes"), 422, "invalid_request", "return_weights", None, None),
    ("self-attention-keys", {"model": "self_attention", "queries": seq(3), "keys": seq(3)}, 422,
     "invalid_request", "keys", None, None),
    ("self-attention-too-long", {"model": "self_attention", "queries": seq(1001, d=2)}, 422, "invalid_shape",
     "queries", None, [1, 1001, 2]),
    ("self-attention-max-len", {"model": "self_attention", "queries": seq(1001)}, 422, "invalid_shape",
     "queries", [1, "n <= 1000", 100], [1, 1001, 100]),
    ("model-null", toy(model=None), 422, "invalid_request", "model", None, None),
    ("model-boolean", toy(model=True), 422, "invalid_request", "model", None, None),
    ("ragged-keys-rows", toy(keys=[K[0], K[1][:9]]), 422, "invalid_shape", "keys", None, None),
    ("boolean-among-numbers", toy(queries=[[[True] + [0.5] * 19]] * 2), 422, "invalid_request", "queries", None,
     None),
    ("lens-boolean", toy(valid_lens=[True, 1]), 422, "invalid_request", "valid_lens", None, None),
    ("lens-2d-fraction", toy(valid_lens=[[2.0], [0.5]]), 422, "invalid_request", "valid_lens",
     "integers from 0 to n_k = 10", 0.5),
    ("array-among-numbers", toy(keys=[K[0], K[1][:9] + [[[1.0], 1.0]]]), 422, "invalid_shape", "keys", None, None),
    ("string-among-numbers", toy(values=[V[0], V[1][:9] + [[0.0, 1.0, "2", 3.0]]]), 422, "invalid_request",
     "values", None, None),
    ("lens-null-inside", toy(valid_lens=[2, None]), 422, "invalid_request", "valid_lens", None, None),
    ("unknown-field-long", toy(**{"x" * 10000: 1}), 422, "invalid_request", "x" * 64, None, None),
    # simdjson cannot look such a key up by name (found by schemathesis): orjson reads the body instead
    ("unknown-field-nul", toy(**{"a\u0000b": 1}), 422, "invalid_request", "a\u0000b", None, None),
    ("unknown-model-long", toy(model="m" * 100000), 404, "model_not_found", "model", None, None),
    # Finite inputs whose scores (q·k = 2e76) or projections pass float32: PyTorch's answer would be NaN.
    ("scores-overflow", toy(model="dot_product", queries=[[[1e38, 1e38]]] * 2, keys=[[[1e38, 1e38]] * 10] * 2), 422,
     "not_finite", None, None, None),
    ("projections-overflow", {"model": "multi_head", "queries": np.ones((1, 3, 100)).tolist(),
                              "keys": np.ones((1, 3, 100)).tolist(), "values": np.full((1, 3, 100), 3e38).tolist()},
     422, "not_finite", None, None, None),
    ("self-attention-overflow", {"model": "self_attention", "queries": np.full((1, 3, 100), 1e36).tolist()}, 422,
     "not_finite", None, None, None),
]

# The exact words of a client error: JSON's vocabulary, where the problem is, nothing of Python's.
MESSAGES = [
    ("model-null", "model must be a string (a name of GET /models), got null"),
    ("model-boolean", "model must be a string (a name of GET /models), got a boolean"),
    ("model-not-string", "model must be a string (a name of GET /models), got a number"),
    ("queries-string", "queries must be an array of arrays of arrays of numbers (batch, n, features), got a string"),
    ("ragged-keys-rows", "keys is ragged: keys[1] has 9 items, keys[0] has 10; every row must have the same length"),
    ("ragged-queries", "queries is ragged: queries[1][0] has 19 items, queries[0][0] has 20; every row must have "
     "the same length"),
    ("ragged-depth", "keys is ragged: keys[1][0] is a number where keys[0][0] is an array"),
    ("boolean-among-numbers", "queries[0][0][0] is a boolean: queries must hold only numbers"),
    ("booleans-in-keys", "keys[0][0][0] is a boolean: keys must hold only numbers"),
    ("null-in-values", "values[0][0][0] is null: values must hold only numbers"),
    ("string-among-numbers", "values[1][9][2] is a string: values must hold only numbers"),
    ("array-among-numbers", "keys[1][9][0] is an array: keys must hold only numbers"),
    ("lens-boolean", "valid_lens[0] is a boolean: valid_lens must hold only numbers"),
    ("lens-null-inside", "valid_lens[1] is null: valid_lens must hold only numbers"),
    ("lens-int64-min", "valid_lens must be between 0 and n_k = 10, got -9223372036854775808"),
    ("lens-fraction", "valid_lens must be whole numbers, got 2.5"),
    ("lens-2d-fraction", "valid_lens must be whole numbers, got 0.5"),
    ("lens-string", "valid_lens must be null or an array of integers (batch) or (batch, n_q), got a string"),
    ("nan-token", "the request body is not valid JSON: NaN and Infinity are not JSON numbers (line 1 column 16)"),
    ("infinity-token", "the request body is not valid JSON: NaN and Infinity are not JSON numbers (line 1 column 16)"),
    ("unknown-field", "unknown field 'valid_len'; expected: model, version, queries, keys, values, scores, "
     "valid_lens, return_weights"),
    ("unknown-field-long", "unknown field '" + "x" * 64 + "'... (10000 characters); expected: model, version, "
     "queries, keys, values, scores, valid_lens, return_weights"),
    ("scores-overflow", "the outputs of dot_product for these inputs are not finite: they are within float32's "
     "range (|x| <= 3.4e38), but a score or a projection of them is not; send smaller numbers"),
    ("unknown-model-long", "'" + "m" * 64 + "'... (100000 characters) is not a model's name (a name is 1-64 "
     "letters, digits, '_', '-' or '.', starting with a letter or digit); available: additive, dot_product, "
     "masked_softmax, multi_head, positional_encoding, self_attention"),
]
_PYTHON_WORDS = ("NoneType", "numpy", "inhomogeneous", "dtype", "ndarray", "float64", "'list'", "'dict'", "'str'",
                 "Traceback", "setting an array element", "object of type", "'bool'")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(client, case):
    _, body, status, code, field, expected, received = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/attend", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"}
    assert error["code"] == code
    assert error.get("field") == field
    assert error["message"] and not any(word in error["message"] for word in _PYTHON_WORDS), error["message"]
    assert len(response.content) < 2048  # a short excerpt of the client's input at most, never all of it
    if expected is not None:
        assert error["expected"] == expected
    if received is not None:
        assert error["received"] == received


@pytest.mark.parametrize("case", MESSAGES, ids=[c[0] for c in MESSAGES])
def test_error_messages_speak_the_api(client, case):
    name, message = case
    body = next(c[1] for c in CASES if c[0] == name)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/attend", content=content, headers={"content-type": "application/json"})
    assert response.json()["error"]["message"] == message


def test_integral_float_lengths_are_lengths(client):
    """What `tensor.tolist()` of a float tensor gives: 2.0 is the length 2."""
    ints = client.post("/attend", json=toy(valid_lens=[2, 6])).json()
    for lens in ([2.0, 6.0], [2.0, 6], [[2.0], [6.0]]):
        response = client.post("/attend", json=toy(valid_lens=lens))
        assert response.status_code == 200, response.text
        assert response.json() == ints


def test_integers_beyond_64_bits_are_numbers(client):
    """JSON allows them; simdjson does not parse them, the slower path does."""
    big = 12345678901234567890123
    body = json.dumps(dot(values=[[[big] * 4] * 10] * 2)).encode()
    response = client.post("/attend", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()["outputs"], np.full((2, 1, 4), np.float32(big)), rtol=1e-6)


def test_messages_say_what_is_wrong(client):
    msg = client.post("/attend", json=toy(keys=K + K[:1])).json()["error"]["message"]
    assert msg == "keys has batch = 3 on axis 0, but queries has batch = 2"
    msg = client.post("/attend", json=toy(queries=[[[0.0] * 19]] * 2)).json()["error"]["message"]
    assert msg == "queries must have 20 features (axis 2) for model additive, got 19"
    msg = client.post("/attend", json=toy(valid_lens=[2, 11])).json()["error"]["message"]
    assert msg == "valid_lens must be between 0 and n_k = 10, got 11"


def test_wrong_content_type_is_415(client):
    response = client.post("/attend", content=json.dumps(TOY), headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert response.json()["error"] == {"code": "unsupported_media_type",
                                        "message": "Content-Type must be application/json, got text/plain",
                                        "expected": "application/json", "received": "text/plain"}


def test_unknown_route_and_method_use_the_same_body(client):
    response = client.get("/nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = client.get("/attend")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_body_over_the_limit_is_413(settings):
    small = settings.model_copy(update={"max_body_bytes": 1024})
    with TestClient(create_app(small)) as client:
        big = json.dumps(TOY).encode() + b" " * 2048  # trailing blanks: still valid JSON
        headers = {"content-type": "application/json"}
        response = client.post("/attend", content=big, headers=headers)  # Content-Length says it
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert response.json()["error"]["expected"] == 1024
        # Chunked, no Content-Length: refused while reading
        response = client.post("/attend", content=iter([big[:1000], big[1000:]]), headers=headers)
        assert response.status_code == 413
        assert client.post("/attend", json=toy(values=V[:1] * 2)).status_code == 200


def test_bad_requests_do_not_disturb_concurrent_good_ones(client):
    good = [toy(valid_lens=[i % 3, 10 - i % 5]) for i in range(24)]
    bad = [c[1] for c in CASES if isinstance(c[1], dict)]

    def send(body):
        return client.post("/attend", json=body)

    with ThreadPoolExecutor(8) as pool:
        mixed = [x for pair in zip(good, bad, strict=False) for x in pair] + good[len(bad):]
        responses = list(pool.map(send, mixed))
    for body, response in zip(mixed, responses, strict=True):
        if body in good:
            assert response.status_code == 200
            lens = body["valid_lens"]
            weights = np.array(response.json()["attention_weights"])
            for b, n in enumerate(lens):
                expected = [1 / n] * n + [0] * (10 - n) if n else [0] * 10
                np.testing.assert_allclose(weights[b, 0], expected, rtol=1e-6)
        else:
            assert 400 <= response.status_code < 500
    assert client.get("/health/ready").status_code == 200
