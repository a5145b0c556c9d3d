"""The Open Inference Protocol: Triton's own client (sync and aio, binary tensors on and off) against
the real server gives /attend's numbers for every kind; metadata and config match the repository;
bad protocol input gets a 4xx with the protocol's error body; both protocols batch together."""

import asyncio
import gzip
import json
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient

from export.repository import KINDS, read_config
from service.http.schemas import toy_request
from tests.server import running_service
from tests.service.test_batching import make_body

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(repository):
    with running_service(repository) as (url, _):
        yield url


def _arrays(body: bytes) -> dict:
    """/attend's request as the protocol's tensors: float32 arrays, valid lengths int64."""
    data = json.loads(body)
    tensors = {k: np.array(v, dtype=np.float32) for k, v in data.items() if k in ("queries", "keys", "values",
                                                                                     "scores")}
    if data.get("valid_lens") is not None:
        tensors["valid_lens"] = np.array(data["valid_lens"], dtype=np.int64)
    return data["model"], tensors


def _inputs(module, tensors, binary):
    inputs = []
    for name, array in tensors.items():
        tensor = module.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return inputs


def _bodies():
    rng = np.random.default_rng(3)
    toy = json.dumps(toy_request()).encode()
    bodies = [toy]
    for kind in KINDS:
        for form in ("absent", "1d", "2d"):
            if kind == "positional_encoding" and form != "absent":
                continue
            bodies.append(make_body(kind, rng, int(rng.integers(1, 4)), int(rng.integers(1, 6)),
                                    int(rng.integers(1, 6)), form))
    return bodies


def _expected(url, body, headers=None):
    response = httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"} | (headers or {}))
    assert response.status_code == 200, response.text
    return response.json()


def _check(result, expected):
    for name in ("outputs", "attention_weights", "P"):
        if expected.get(name) is None:
            continue
        np.testing.assert_allclose(result.as_numpy(name), np.array(expected[name]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_sync_gives_attends_numbers(server, binary):
    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    for body in _bodies():
        model, tensors = _arrays(body)
        outputs = [httpclient.InferRequestedOutput(s["name"], binary_data=binary)
                   for s in client.get_model_metadata(model)["outputs"]]
        result = client.infer(model, _inputs(httpclient, tensors, binary), outputs=outputs, request_id="r-1")
        _check(result, _expected(server, body))
        assert result.get_response()["id"] == "r-1" and result.get_response()["model_name"] == model


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_aio_gives_attends_numbers(server, binary):
    async def run():
        client = aioclient.InferenceServerClient(server.removeprefix("http://"))
        try:
            for body in _bodies():
                model, tensors = _arrays(body)
                outputs = [aioclient.InferRequestedOutput(s["name"], binary_data=binary)
                           for s in (await client.get_model_metadata(model))["outputs"]]
                result = await client.infer(model, _inputs(aioclient, tensors, binary), outputs=outputs)
                _check(result, _expected(server, body))
        finally:
            await client.close()

    asyncio.run(run())


def test_metadata_and_config_match_the_repository(server, repository):
    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    for kind in KINDS:
        config = read_config(repository / kind)
        meta = client.get_model_metadata(kind)
        assert meta["versions"] == [str(config.version)] and client.is_model_ready(kind)
        assert [(t["name"], t["shape"]) for t in meta["inputs"]] == \
            [(s["name"], [d if isinstance(d, int) else -1 for d in s["shape"]]) for s in config.inputs]
        assert [t["datatype"] for t in meta["inputs"]] == [{"float32": "FP32", "int64": "INT64"}[s["dtype"]]
                                                           for s in config.inputs]
        triton = client.get_model_config(kind)
        batched = kind != "positional_encoding"  # its P has no batch axis
        assert triton["max_batch_size"] == (1024 if batched else 0)
        assert [(t["name"], t["dims"]) for t in triton["input"]] == \
            [(s["name"], [d if isinstance(d, int) else -1 for d in (s["shape"][1:] if batched else s["shape"])])
             for s in config.inputs]
        assert client.get_model_metadata(kind, model_version=str(config.version))["name"] == kind
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("additive", model_version="7")


def test_only_the_requested_outputs_come_back(server):
    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    model, tensors = _arrays(json.dumps(toy_request()).encode())
    result = client.infer(model, _inputs(httpclient, tensors, True), outputs=[
        httpclient.InferRequestedOutput("outputs")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["outputs"]
    assert result.as_numpy("attention_weights") is None
    np.testing.assert_allclose(result.as_numpy("outputs"), [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(server, algorithm):
    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    model, tensors = _arrays(json.dumps(toy_request()).encode())
    result = client.infer(model, _inputs(httpclient, tensors, True), request_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("outputs"), [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)


def test_other_float_and_int_types_are_converted(server):
    body = json.dumps(toy_request()).encode()
    expected = _expected(server, body)
    client = httpclient.InferenceServerClient(server.removeprefix("http://"))
    model, tensors = _arrays(body)
    inputs = []
    for name, array in tensors.items():
        dtype, datatype = (np.int32, "INT32") if name == "valid_lens" else (np.float64, "FP64")
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array.astype(dtype))
        inputs.append(tensor)
    _check(client.infer(model, inputs), expected)
    half = [httpclient.InferInput(n, list(a.shape), "FP16") for n, a in tensors.items() if n != "valid_lens"]
    for tensor, (_, array) in zip(half, tensors.items(), strict=False):
        tensor.set_data_from_numpy(array.astype(np.float16))
    result = client.infer(model, half)
    np.testing.assert_allclose(result.as_numpy("outputs")[1], [[18.0, 19.0, 20.0, 21.0]], rtol=1e-3)


def test_both_protocols_merge_into_the_same_runs(server):
    """JSON /attend requests and binary protocol requests of one model, sent at the same moment (a
    barrier): merged runs, each answer its own."""
    rng = np.random.default_rng(9)
    bodies = [make_body("dot_product", rng, 2, 3, 4, form) for form in ("absent", "1d", "2d") * 8]
    expected = [_expected(server, b) for b in bodies]
    before = httpx.get(f"{server}/metrics").text

    def total(text, name):
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + '{model="dot_'))

    barrier = threading.Barrier(len(bodies))

    def send(item):
        i, body = item
        if i % 2:
            with httpx.Client(base_url=server) as http:
                http.get("/health/live")  # connected before the barrier
                barrier.wait()
                return http.post("/attend", content=body, headers={"content-type": "application/json"}).json()
        client = httpclient.InferenceServerClient(server.removeprefix("http://"))
        _, tensors = _arrays(body)
        inputs = _inputs(httpclient, tensors, True)
        client.is_server_live()
        barrier.wait()
        result = client.infer("dot_product", inputs)
        return {"outputs": result.as_numpy("outputs"), "attention_weights": result.as_numpy("attention_weights")}

    for _ in range(3):
        barrier.reset()
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(send, enumerate(bodies)))
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(np.array(g["outputs"]), np.array(e["outputs"]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.array(g["attention_weights"]), np.array(e["attention_weights"]), rtol=1e-5,
                                       atol=1e-6)
    after = httpx.get(f"{server}/metrics").text
    runs = total(after, "attend_batch_requests_count") - total(before, "attend_batch_requests_count")
    served = total(after, "attend_batch_requests_sum") - total(before, "attend_batch_requests_sum")
    assert served == 3 * len(bodies) and runs < served


# --- bad protocol input: 4xx with {"error": "..."} ----------------------------------------------

TOY = toy_request()
Q = np.array(TOY["queries"], dtype=np.float32)
K = np.array(TOY["keys"], dtype=np.float32)
V = np.array(TOY["values"], dtype=np.float32)


def _binary(inputs, outputs=None, header_length=None, tail_extra=b"", cut=0, **top):
    """A binary request: (body, headers). `inputs`: (name, datatype, shape, bytes, stated size)."""
    entries, blobs = [], []
    for name, datatype, shape, blob, size in inputs:
        entries.append({"name": name, "datatype": datatype, "shape": shape,
                        "parameters": {"binary_data_size": len(blob) if size is None else size}})
        blobs.append(blob)
    head = json.dumps({"inputs": entries, **({"outputs": outputs} if outputs else {}), **top}).encode()
    body = head + b"".join(blobs) + tail_extra
    if cut:
        body = body[:-cut]
    length = str(len(head) if header_length is None else header_length)
    return body, {"Inference-Header-Content-Length": length}


def _toy(**changes):
    inputs = {"queries": ("queries", "FP32", list(Q.shape), Q.tobytes(), None),
              "keys": ("keys", "FP32", list(K.shape), K.tobytes(), None),
              "values": ("values", "FP32", list(V.shape), V.tobytes(), None)}
    for name, value in changes.items():
        if value is None:
            inputs.pop(name)
        else:
            inputs[name] = value
    return list(inputs.values())


NAN = np.full(Q.shape, np.nan, dtype=np.float32)
# (id, body and headers, status, words of the message)
BAD = [
    ("size-larger-than-body", _binary(_toy(values=("values", "FP32", list(V.shape), V.tobytes(), V.nbytes + 4))),
     400, "input values: binary_data_size is 324 bytes, but shape [2, 10, 4] of FP32 takes 320"),
    ("size-smaller-than-shape", _binary(_toy(keys=("keys", "FP32", [2, 10, 2], K.tobytes()[:-4], None))), 400,
     "binary_data_size is 156 bytes, but shape [2, 10, 2] of FP32 takes 160"),
    ("truncated-body", _binary(_toy(), cut=8), 400,
     "input values: binary_data_size is 320 bytes, but only 312 bytes of binary data are left"),
    ("extra-bytes", _binary(_toy(), tail_extra=b"\0" * 12), 400, "12 bytes of binary data that no input"),
    ("header-length-zero", _binary(_toy(), header_length=0), 400, "Inference-Header-Content-Length must be"),
    ("header-length-past-body", _binary(_toy(), header_length=10**9), 400, "Inference-Header-Content-Length"),
    ("header-length-not-a-number", _binary(_toy(), header_length="12a"), 400, "Inference-Header-Content-Length"),
    ("header-length-in-the-binary", _binary(_toy(), header_length=300), 400, "not valid JSON"),
    ("int8", _binary(_toy(queries=("queries", "INT8", [2, 1, 20], b"\0" * 40, None))), 400,
     "input queries: datatype 'INT8' is not accepted; send FP32 or FP16 or FP64"),
    ("bytes", _binary(_toy(queries=("queries", "BYTES", [2, 1, 20], b"\0" * 40, None))), 400, "'BYTES'"),
    ("float-lengths", _binary(_toy(valid_lens=("valid_lens", "FP32", [2], np.array([2, 6], np.float32).tobytes(),
                                               None))), 400, "input valid_lens: datatype 'FP32' is not accepted"),
    ("unknown-input", _binary(_toy(extra=("extra", "FP32", [1], b"\0" * 4, None))), 400,
     "model additive has no input 'extra'"),
    ("missing-input", _binary(_toy(keys=None)), 400, "needs input(s) keys"),
    ("twice", _binary([*_toy(), ("keys", "FP32", list(K.shape), K.tobytes(), None)]), 400, "input keys is given twice"),
    ("negative-size", _binary(_toy(queries=("queries", "FP32", [2, 1, 20], Q.tobytes(), -160))), 400,
     "binary_data_size must be a non-negative integer"),
    ("datatype-a-list", _binary(_toy(queries=("queries", ["FP32"], [2, 1, 20], Q.tobytes(), None))), 400,
     "input queries: datatype an array is not accepted; send FP32 or FP16 or FP64"),
    ("shape-not-a-list", _binary(_toy(queries=("queries", "FP32", "2,1,20", Q.tobytes(), None))), 400,
     "shape must be a list"),
    ("nan", _binary(_toy(queries=("queries", "FP32", list(Q.shape), NAN.tobytes(), None))), 422,
     "input queries: queries must hold finite float32 numbers"),
    ("shape-of-the-wrong-rank", _binary(_toy(queries=("queries", "FP32", [2, 20], Q.tobytes(), None))), 422,
     "input queries: queries must be 3-D"),
    ("unknown-output", _binary(_toy(), outputs=[{"name": "logits"}]), 400, "model additive has no output 'logits'"),
    ("id-not-a-string", _binary(_toy(), id=7), 400, "id must be a string"),
    ("timeout-not-a-number", _binary(_toy(), parameters={"timeout": "soon"}), 400,
     "parameter timeout must be a non-negative integer, got a string"),
    ("timeout-negative", _binary(_toy(), parameters={"timeout": -5}), 400,
     "parameter timeout must be a non-negative integer"),
    ("json-count", ({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [2, 1, 20], "data": [0.5] * 39},
                                {"name": "keys", "datatype": "FP32", "shape": [2, 10, 2], "data": K.ravel().tolist()},
                                {"name": "values", "datatype": "FP32", "shape": [2, 10, 4],
                                 "data": V.ravel().tolist()}]}, {}), 400,
     "input queries: data holds 39 values, shape [2, 1, 20] takes 40"),
    ("json-strings", ({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [1], "data": ["1"]}]}, {}), 400,
     "input queries: data must hold only numbers"),
    ("json-float-lengths", ({"inputs": [{"name": "valid_lens", "datatype": "INT64", "shape": [2], "data": [2.5, 3]}]},
                            {}), 400, "input valid_lens: data must hold only integers"),
    ("not-json", (b"{inputs", {}), 400, "not valid JSON"),
    ("no-inputs", ({"outputs": []}, {}), 400, "inputs must be a list of tensors"),
    ("bad-gzip", (b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"}), 400, "not valid gzip data"),
    ("brotli", (b"{}", {"Content-Encoding": "br"}), 415, "Content-Encoding 'br' is not supported"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=30) as client:
        yield client


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_protocol_input(http, case):
    _, (body, headers), status, words = case
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    response = http.post("/v2/models/additive/infer", content=body, headers=headers)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and isinstance(response.json()["error"], str)
    assert words in response.json()["error"], response.json()["error"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_outputs_that_overflow_float32_are_refused(http, binary):
    """Finite queries and keys whose scores are not (q·k = 2e76): a 422 that says so, not NaN."""
    big, values = np.full((1, 2, 2), 1e38, np.float32), np.ones((1, 2, 3), np.float32)
    arrays = {"queries": big, "keys": big, "values": values}
    if binary:
        body, headers = _binary([(name, "FP32", list(a.shape), a.tobytes(), None) for name, a in arrays.items()])
    else:
        inputs = [{"name": name, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
                  for name, a in arrays.items()]
        body, headers = json.dumps({"inputs": inputs}).encode(), {}
    response = http.post("/v2/models/dot_product/infer", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert response.json() == {"error": "the outputs of dot_product for these inputs are not finite: they are within "
                                        "float32's range (|x| <= 3.4e38), but a score or a projection of them is not; "
                                        "send smaller numbers"}


def test_gzip_bomb_is_bounded(repository):
    """Compressed bodies are refused as soon as they inflate past ATTEND_MAX_INFLATE_RATIO times their
    bytes, and are inflated at most to ATTEND_MAX_BODY_BYTES."""
    bomb = gzip.compress(b'{"inputs": [' + b" " * (8 * 1024 * 1024) + b"]}")  # ~1000 times
    with running_service(repository, ATTEND_MAX_BODY_BYTES=str(1024 * 1024)) as (url, _):
        response = httpx.post(f"{url}/v2/models/additive/infer", content=bomb, headers={"Content-Encoding": "gzip"})
        assert response.status_code == 413
        assert response.json()["error"].startswith("the body inflates more than 100 times (ATTEND_MAX_INFLATE_RATIO)")
    with running_service(repository, ATTEND_MAX_BODY_BYTES=str(1024 * 1024),
                         ATTEND_MAX_INFLATE_RATIO="5000") as (url, _):
        response = httpx.post(f"{url}/v2/models/additive/infer", content=bomb, headers={"Content-Encoding": "gzip"})
        assert response.status_code == 413
        assert response.json()["error"].startswith("the decompressed body is over the limit of 1048576 bytes")


def test_errors_and_routes_of_the_protocol(http):
    assert http.post("/v2/models/nope/infer", content=b"{}").status_code == 404
    assert http.post("/v2/models/additive/versions/9/infer", content=b"{}").json() == \
        {"error": "version '9' of model 'additive' is not loaded; loaded: 1"}
    assert http.get("/v2/models/nope").status_code == 404 and set(http.get("/v2/models/nope").json()) == {"error"}
    assert http.get("/v2/nowhere").json() == {"error": "Not Found"}
    deflated = zlib.compress(json.dumps({"inputs": [
        {"name": "queries", "datatype": "FP32", "shape": [2, 1, 20], "data": Q.ravel().tolist()},
        {"name": "keys", "datatype": "FP32", "shape": [2, 10, 2], "data": K.ravel().tolist()},
        {"name": "values", "datatype": "FP32", "shape": [2, 10, 4], "data": V.tolist()}]}).encode())
    response = http.post("/v2/models/additive/infer", content=deflated, headers={"Content-Encoding": "deflate"})
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"][:4] == [18.0, 19.0, 20.0, 21.0]  # no lengths: all keys


def test_binary_response_layout(http):
    """Offsets are the running sum of binary_data_size in the order of outputs (what tritonclient reads)."""
    body, headers = _binary(_toy(), outputs=[{"name": "attention_weights", "parameters": {"binary_data": True}},
                                             {"name": "outputs", "parameters": {"binary_data": True}}])
    response = http.post("/v2/models/additive/infer", content=body, headers=headers)
    assert response.headers["content-type"] == "application/octet-stream"
    split = int(response.headers["inference-header-content-length"])
    head = orjson.loads(response.content[:split])
    sizes = [o["parameters"]["binary_data_size"] for o in head["outputs"]]
    assert [o["name"] for o in head["outputs"]] == ["attention_weights", "outputs"] and sizes == [80, 32]
    assert len(response.content) == split + sum(sizes)
    # No valid lengths sent: every key, so each query averages the values' ten rows.
    np.testing.assert_allclose(struct.unpack("<20f", response.content[split:split + 80]), [0.1] * 20, rtol=1e-6)
    np.testing.assert_allclose(struct.unpack("<8f", response.content[split + 80:]), (18, 19, 20, 21) * 2, rtol=1e-6)
