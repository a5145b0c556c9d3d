"""The Open Inference Protocol over gRPC (service/grpc), against the real process (`python -m service`
with ATTEND_GRPC_PORT): Triton's own client, sync and aio, gives /attend's numbers for every kind and
both forms of valid lengths; typed contents and raw_input_contents; metadata, config, readiness and
statistics; errors as status codes naming the input; keys; deadlines; the message limit; a gRPC and an
HTTP request in one batch; off with ATTEND_GRPC_PORT=0; SIGTERM drains a call, and its answer reaches
a slow client whole; ATTEND_WORKERS=2.

The requests below that tritonclient cannot make (typed contents, broken messages) are built with the
stubs tritonclient ships (tritonclient.grpc.service_pb2): this process never imports the service's own
(service.grpc.proto), which would register the same proto files in protobuf's default pool twice.
"""

import asyncio
import functools
import json
import math
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from export.repository import KINDS, read_config
from service.http.schemas import toy_request
from tests.server import ROOT, free_port, running_service
from tests.service.test_batching import make_body
from tests.service.test_v2 import _arrays, _bodies, _check, _expected

pytestmark = pytest.mark.slow

KEY, ADMIN = "grpc-key", "grpc-admin"
# The book's printed example (D2L's additive attention, toy_request()): its outputs.
BOOK_OUTPUTS = [[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    """(HTTP URL, gRPC address) of one service: messages up to 1 MiB; a batch waits up to 20 ms for a
    request that a busy client is about to send. Its log, at the end: no traceback."""
    port = free_port()
    log = tmp_path_factory.mktemp("grpc") / "service.log"
    with running_service(repository, log_path=log, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_MAX_BODY_BYTES=str(1 << 20), ATTEND_MAX_BATCH_WAIT_US="20000") as (url, _):
        yield url, f"127.0.0.1:{port}"
    assert "Traceback" not in log.read_text()


def _inputs(module, tensors):
    inputs = []
    for name, array in tensors.items():
        tensor = module.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(array)  # tritonclient.grpc: always raw_input_contents
        inputs.append(tensor)
    return inputs


def _stub(address):
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.GRPCInferenceServiceStub(channel)


def _typed_request(model, tensors, outputs=(), floats="FP32"):
    """A ModelInferRequest with every input's data in its typed contents (fp32_contents or fp64_contents,
    as `floats` says, and int64_contents)."""
    request = pb.ModelInferRequest(model_name=model)
    for name, array in tensors.items():
        tensor = request.inputs.add(name=name, shape=array.shape)
        if array.dtype == np.int64:
            tensor.datatype = "INT64"
            tensor.contents.int64_contents.extend(array.ravel().tolist())
        else:
            tensor.datatype = floats
            getattr(tensor.contents, f"{floats.lower()}_contents").extend(array.ravel().tolist())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _raw_request(model, tensors, outputs=()):
    request = pb.ModelInferRequest(model_name=model)
    for name, array in tensors.items():
        request.inputs.add(name=name, shape=array.shape, datatype="INT64" if array.dtype == np.int64 else "FP32")
        request.raw_input_contents.append(array.tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _outputs(response):
    """name -> array of a ModelInferResponse (raw_output_contents, FP32)."""
    return {o.name: np.frombuffer(raw, dtype="<f4").reshape(o.shape)
            for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}


def _forms():
    """Every default kind with valid lengths absent, 1-D and 2-D (positional encoding has none)."""
    forms = {(json.loads(b)["model"], "none" if "valid_lens" not in json.loads(b) else
              f"{np.array(json.loads(b)['valid_lens']).ndim}d") for b in _bodies()}
    return forms


def test_the_stubs_are_generated_from_the_vendored_protos():
    result = subprocess.run([sys.executable, "scripts/grpc_stubs.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_every_kind_and_both_valid_length_forms_are_covered():
    forms = _forms()
    assert {k for k, _ in forms} == set(KINDS)
    assert {f for k, f in forms if k != "positional_encoding"} == {"none", "1d", "2d"}


def test_tritonclient_grpc_sync_gives_attends_numbers(server):
    url, address = server
    client = grpcclient.InferenceServerClient(address)
    for body in _bodies():
        model, tensors = _arrays(body)
        result = client.infer(model, _inputs(grpcclient, tensors), request_id="g-1")
        _check(result, _expected(url, body))
        response = result.get_response()
        assert response.id == "g-1" and response.model_name == model and response.model_version == "1"
    result = client.infer("additive", _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1]))
    np.testing.assert_allclose(result.as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)


def test_tritonclient_grpc_aio_gives_attends_numbers(server):
    url, address = server

    async def run():
        client = aioclient.InferenceServerClient(address)
        try:
            results = await asyncio.gather(*(client.infer(model, _inputs(aioclient, tensors))
                                             for model, tensors in map(_arrays, _bodies())))
        finally:
            await client.close()
        return results

    for body, result in zip(_bodies(), asyncio.run(run()), strict=True):
        _check(result, _expected(url, body))


def test_typed_contents_give_what_raw_contents_give(server):
    url, address = server
    channel, stub = _stub(address)
    with channel:
        for body in _bodies():
            model, tensors = _arrays(body)
            typed = _outputs(stub.ModelInfer(_typed_request(model, tensors)))
            raw = _outputs(stub.ModelInfer(_raw_request(model, tensors)))
            assert typed.keys() == raw.keys() and typed
            for name in typed:
                np.testing.assert_array_equal(typed[name], raw[name])
            expected = _expected(url, body)
            for name, array in typed.items():
                np.testing.assert_allclose(array, np.array(expected[name]), rtol=1e-6, atol=1e-7)
        # FP64 and INT32 are converted, as over HTTP; only the outputs asked for come back, in that order.
        _, tensors = _arrays(json.dumps(toy_request()).encode())
        request = pb.ModelInferRequest(model_name="additive", id="typed")
        for name, array in tensors.items():
            tensor = request.inputs.add(name=name, shape=array.shape)
            if name == "valid_lens":
                tensor.datatype = "INT32"
                tensor.contents.int_contents.extend(array.ravel().tolist())
            else:
                tensor.datatype = "FP64"
                tensor.contents.fp64_contents.extend(array.ravel().tolist())
        request.outputs.add(name="outputs")
        response = stub.ModelInfer(request)
        assert [o.name for o in response.outputs] == ["outputs"] and response.id == "typed"
        np.testing.assert_allclose(_outputs(response)["outputs"], BOOK_OUTPUTS, rtol=1e-6)


def test_a_large_message_gives_what_a_small_one_gives(server):
    """Over 64 KiB the guard lifts raw_input_contents, fp32_contents and fp64_contents out of the message
    before protobuf parses it (service.grpc.wire.split): every kind still answers /attend's numbers, with the
    tensors at every offset mod 4 in the message (an id of 0-3 bytes shifts them) and a raw field ahead of the
    fields it belongs with; as a ModelInfer call and as ModelStreamInfer's message, in turn."""
    url, address = server
    rng = np.random.default_rng(8)
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               response_deserializer=pb.ModelInferResponse.FromString)
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)

    def streamed(message: bytes) -> pb.ModelInferResponse:
        (answer,) = list(stream(iter([message]), timeout=30))
        assert not answer.error_message, answer.error_message
        return answer.infer_response

    with channel:
        for kind, shift in ((k, s) for k in KINDS for s in range(4)):
            b, n = 4, 8
            while True:
                body = make_body(kind, rng, b, n, n, "absent" if kind == "positional_encoding" else "1d")
                model, tensors = _arrays(body)
                if sum(a.nbytes for a in tensors.values()) > 80_000:
                    break
                b, n = (b, 2 * n) if n < 512 else (2 * b, n)  # within positional encoding's max_len
            request = _raw_request(model, tensors)
            request.id = "i" * shift
            first = pb.ModelInferRequest(raw_input_contents=request.raw_input_contents[:1])
            del request.raw_input_contents[0]
            message = first.SerializeToString() + request.SerializeToString()  # protobuf merges the two
            assert pb.ModelInferRequest.FromString(message).raw_input_contents[0] == first.raw_input_contents[0]
            assert 64 * 1024 < len(message) < 1 << 20, (kind, len(message))
            typed = _typed_request(model, tensors, floats="FP64" if shift == 3 else "FP32")
            typed.id = request.id
            expected = _expected(url, body)
            names = [name for name in ("outputs", "attention_weights", "P") if expected.get(name) is not None]
            for sent in (message, typed.SerializeToString()):
                response = (streamed if shift % 2 else call)(sent)
                assert response.id == request.id and response.model_name == model
                outputs = _outputs(response)
                assert sorted(outputs) == sorted(names) and names, kind
                for name in names:
                    np.testing.assert_allclose(outputs[name], np.array(expected[name]), rtol=1e-6, atol=1e-7,
                                               err_msg=kind)


def test_metadata_config_and_readiness_match_the_repository(server, repository):
    url, address = server
    client = grpcclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata.name == "attend" and list(metadata.extensions) == httpx.get(f"{url}/v2").json()["extensions"]
    assert "statistics" in metadata.extensions and "model_repository" not in metadata.extensions
    for kind in KINDS:
        config = read_config(repository / kind)
        meta = client.get_model_metadata(kind, as_json=True)
        assert meta == httpx.get(f"{url}/v2/models/{kind}").json() | {"inputs": meta["inputs"],
                                                                       "outputs": meta["outputs"]}
        assert [(t["name"], [int(d) for d in t["shape"]]) for t in meta["inputs"]] == \
            [(s["name"], [d if isinstance(d, int) else -1 for d in s["shape"]]) for s in config.inputs]
        assert client.is_model_ready(kind) and client.is_model_ready(kind, model_version=str(config.version))
        triton = client.get_model_config(kind).config
        rest = httpx.get(f"{url}/v2/models/{kind}/config").json()
        assert triton.max_batch_size == rest["max_batch_size"] == (1024 if kind != "positional_encoding" else 0)
        assert [(t.name, list(t.dims), t.optional) for t in triton.input] == \
            [(t["name"], t["dims"], t.get("optional", False)) for t in rest["input"]]
        assert triton.parameters["kind"].string_value == kind and triton.backend == "onnxruntime"
    assert not client.is_model_ready("nope") and not client.is_model_ready("additive", model_version="7")


def test_statistics_move_after_an_inference(server):
    url, address = server
    client = grpcclient.InferenceServerClient(address)
    before = client.get_inference_statistics("dot_product", as_json=True)["model_stats"][0]
    _, tensors = _arrays(make_body("dot_product", np.random.default_rng(1), 3, 2, 4, "1d"))
    for _ in range(2):
        client.infer("dot_product", _inputs(grpcclient, tensors))
    after = client.get_inference_statistics("dot_product", as_json=True)["model_stats"][0]
    count = lambda stats, key: int(stats["inference_stats"][key].get("count", 0))  # noqa: E731
    assert count(after, "success") == count(before, "success") + 2
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 6  # 3 rows each
    assert int(after["inference_stats"]["compute_infer"]["ns"]) > int(before["inference_stats"]
                                                                      .get("compute_infer", {}).get("ns", 0))
    # The same numbers as HTTP's statistics extension (both read the one dict).
    rest = httpx.get(f"{url}/v2/models/dot_product/stats").json()["model_stats"][0]
    assert int(rest["inference_stats"]["success"]["count"]) == count(after, "success")
    assert len(client.get_inference_statistics().model_stats) == len(KINDS)
    with pytest.raises(InferenceServerException) as error:
        client.get_inference_statistics("nope")
    assert error.value.status() == "StatusCode.NOT_FOUND"


def _error(call):
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def test_errors_are_status_codes_naming_the_input(server):
    url, address = server
    _, tensors = _arrays(json.dumps(toy_request()).encode())
    channel, stub = _stub(address)
    with channel:
        wrong = dict(tensors, keys=tensors["keys"][:, :, :1])  # additive's keys have 2 features
        code, details = _error(lambda: stub.ModelInfer(_raw_request("additive", wrong)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("input keys: keys must have 2 features (axis 2)") and "expected [" in details \
            and "received [2,10,1]" in details, details
        request = _raw_request("additive", tensors)
        request.inputs[0].datatype = "BYTES"
        code, details = _error(lambda: stub.ModelInfer(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "input queries: datatype 'BYTES' is not accepted; send FP32 or FP16 or FP64"
        request = _raw_request("additive", tensors)
        request.raw_input_contents[1] = request.raw_input_contents[1][:-4]
        code, details = _error(lambda: stub.ModelInfer(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "input keys: raw_input_contents[1] is 156 bytes, but shape [2, 10, 2] of FP32 takes 160"), details
        request = _raw_request("additive", tensors)
        del request.raw_input_contents[-1]
        assert _error(lambda: stub.ModelInfer(request)) == (grpc.StatusCode.INVALID_ARGUMENT, (
            "raw_input_contents has 3 entries for 4 inputs: give every input's data there, in the order of "
            "inputs, or none"))
        request = _raw_request("additive", tensors)
        request.inputs[0].contents.fp32_contents.append(1.0)
        assert _error(lambda: stub.ModelInfer(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "input queries has both contents and raw_input_contents[0]: send one")
        request = _typed_request("additive", tensors)
        del request.inputs[1].contents.fp32_contents[-1]
        assert _error(lambda: stub.ModelInfer(request)) == (grpc.StatusCode.INVALID_ARGUMENT, (
            "input keys: contents.fp32_contents holds 39 values, shape [2, 10, 2] takes 40"))
        # The same over 64 KiB, where the guard lifts the contents out of the message (service.grpc.wire.split).
        large = {name: np.ones((1, 100, 64), np.float32) for name in ("queries", "keys", "values")}
        request = _typed_request("dot_product", large)
        del request.inputs[1].contents.fp32_contents[-1]
        assert request.ByteSize() > 64 * 1024 and _error(lambda: stub.ModelInfer(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "input keys: contents.fp32_contents holds 6399 values, shape "
            "[1, 100, 64] takes 6400")
        request = _raw_request("dot_product", large)
        request.inputs[0].contents.fp32_contents.append(1.0)
        assert request.ByteSize() > 64 * 1024 and _error(lambda: stub.ModelInfer(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "input queries has both contents and raw_input_contents[0]: send one")
        request = _typed_request("additive", {k: v for k, v in tensors.items() if k != "values"})
        assert _error(lambda: stub.ModelInfer(request)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                            "model additive needs input(s) values")
        request = _typed_request("additive", tensors, outputs=["nope"])
        code, details = _error(lambda: stub.ModelInfer(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("model additive has no output 'nope'")
        big = np.full((1, 2, 2), 1e38, np.float32)  # finite, but q·k = 2e76 is not: NaN, refused
        request = _raw_request("dot_product", {"queries": big, "keys": big, "values": np.ones((1, 2, 3), np.float32)})
        code, details = _error(lambda: stub.ModelInfer(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "the outputs of dot_product for these inputs are not finite"), details
        code, details = _error(lambda: stub.ModelInfer(_raw_request("nope", tensors)))
        assert code == grpc.StatusCode.NOT_FOUND and details.startswith("unknown model 'nope'; available: additive")
        request = _raw_request("additive", tensors)
        request.model_version = "7"
        code, details = _error(lambda: stub.ModelInfer(request))
        assert code == grpc.StatusCode.NOT_FOUND and "version '7' of model 'additive' is not loaded" in details
        code, details = _error(lambda: stub.ModelInfer(_raw_request("additive", tensors),
                                                       metadata=[("x-request-timeout-ms", "soon")]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "X-Request-Timeout-Ms" in details
        for value, said in ((-1, "int64_param -1"), ("soon", "string_param")):
            request = _raw_request("additive", tensors)
            if isinstance(value, int):
                request.parameters["timeout"].int64_param = value
            else:
                request.parameters["timeout"].string_param = value
            assert _error(lambda request=request: stub.ModelInfer(request)) == (grpc.StatusCode.INVALID_ARGUMENT, (
                f"parameter timeout must be a non-negative int64_param (microseconds), got {said}"))
        assert _error(lambda: stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())) == (
            grpc.StatusCode.UNIMPLEMENTED, "this server does not implement CudaSharedMemoryStatus")
        # System shared memory is off here (ATTEND_SHARED_MEMORY), as HTTP's routes are 404.
        assert _error(lambda: stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())) == (
            grpc.StatusCode.NOT_FOUND, "system shared memory is off: ATTEND_SHARED_MEMORY=true turns it on, for "
            "clients on this host")
        # Model control is off here: the repository calls are NOT_FOUND, as HTTP's routes are 404.
        code, details = _error(lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest()))
        assert code == grpc.StatusCode.NOT_FOUND and details.startswith("model control is off")
    # Counted with the protocol's label, by the status the code was mapped from.
    metrics = httpx.get(f"{url}/metrics").text
    assert 'attend_requests_total{model="additive",protocol="grpc",status="400"}' in metrics
    assert 'attend_requests_total{model="-",protocol="grpc",status="404"}' in metrics


def test_the_per_request_limits_hold_over_grpc_in_both_forms_of_contents(server):
    """ATTEND_MAX_WEIGHT_ELEMENTS (4 Mi at its default) for a message of a few KB: 1 x 2049 x 2049 weights,
    as raw_input_contents and as typed contents; one query and key fewer is served (its outputs only: the
    weights would be 16 MB, over the client's default message limit)."""
    _, address = server
    channel, stub = _stub(address)
    with channel:
        for n, served in ((2049, False), (2048, True)):
            tensors = {name: np.ones((1, n, 1), dtype=np.float32) for name in ("queries", "keys", "values")}
            for request in (_raw_request("dot_product", tensors, ["outputs"]),
                            _typed_request("dot_product", tensors, ["outputs"])):
                if served:
                    assert _outputs(stub.ModelInfer(request))["outputs"].shape == (1, n, 1)
                    continue
                code, details = _error(lambda request=request: stub.ModelInfer(request))
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "batch * heads * n_q * n_k (the attention " \
                    "weights) is 4198401, over this service's limit of 4194304 (ATTEND_MAX_WEIGHT_ELEMENTS)" \
                    in details, details


def test_a_message_over_the_limit_is_resource_exhausted_and_the_server_goes_on(server):
    url, address = server
    client = grpcclient.InferenceServerClient(address)
    big = np.zeros((1, 512, 1024), dtype=np.float32)  # 2 MiB of queries: over ATTEND_MAX_BODY_BYTES (1 MiB)
    tensor = grpcclient.InferInput("scores", list(big.shape), "FP32")
    tensor.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException) as error:
        client.infer("masked_softmax", [tensor])
    assert error.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert httpx.get(f"{url}/health/live").status_code == 200
    result = client.infer("additive", _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1]))
    np.testing.assert_allclose(result.as_numpy("outputs"), BOOK_OUTPUTS, rtol=1e-6)


def test_grpc_and_http_requests_share_batches(server):
    """HTTP requests of 2 rows and gRPC requests of 3 rows of one model, sent at the same moment (a
    barrier): a session run of 5, 7, 8, 10 or more rows (the model's batch_stats) can only be one that
    merged both protocols' requests. Each answer is its own."""
    url, address = server
    rng = np.random.default_rng(5)
    over_http = [make_body("masked_softmax", rng, 2, 3, 4, "2d") for _ in range(3)]
    over_grpc = [make_body("masked_softmax", rng, 3, 3, 4, "1d") for _ in range(3)]
    expected = [_expected(url, b)["outputs"] for b in over_http + over_grpc]
    http_only, grpc_only = {2, 4, 6}, {3, 6, 9}

    def sizes():
        stats = httpx.get(f"{url}/v2/models/masked_softmax/stats").json()["model_stats"][0]
        return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}

    barrier = threading.Barrier(6)

    def send(body):
        if body in over_http:
            with httpx.Client(base_url=url) as http:
                http.get("/health/live")  # connected before the barrier
                barrier.wait()
                return http.post("/attend", content=body, headers={"content-type": "application/json"}).json()[
                    "outputs"]
        client = grpcclient.InferenceServerClient(address)
        inputs = _inputs(grpcclient, _arrays(body)[1])
        client.is_server_live()
        barrier.wait()
        return client.infer("masked_softmax", inputs).as_numpy("outputs")

    mixed = set()
    with ThreadPoolExecutor(6) as pool:
        for _ in range(20):  # each try a chance (the six reach the server within the batch's wait, or not)
            before = sizes()
            barrier.reset()
            for got, want in zip(pool.map(send, over_http + over_grpc), expected, strict=True):
                np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-7)
            after = sizes()
            ran = {size for size, runs in after.items() if runs > before.get(size, 0)}
            mixed |= ran - http_only - grpc_only
            if mixed:
                break
    assert mixed, "no session run merged an HTTP request with a gRPC one"


def test_deadlines(server):
    """grpc-timeout: a call whose deadline passes ends DEADLINE_EXCEEDED; the server goes on."""
    url, address = server
    client = grpcclient.InferenceServerClient(address)
    rng = np.random.default_rng(2)
    scores = rng.normal(size=(16, 128, 120)).astype(np.float32)  # just under the message limit, 1 MiB
    tensor = grpcclient.InferInput("scores", list(scores.shape), "FP32")
    tensor.set_data_from_numpy(scores)
    with pytest.raises(InferenceServerException) as error:
        client.infer("masked_softmax", [tensor], client_timeout=0.0005)
    assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    result = client.infer("masked_softmax", [tensor], client_timeout=30)
    assert result.as_numpy("outputs").shape == (16, 128, 120)


def test_grpc_health_checking_follows_readiness(server, repository, tmp_path):
    """grpc.health.v1 (Kubernetes' grpc probes, grpc-health-probe): SERVING while ready, for the server and its
    one service; an unknown service NOT_FOUND. With a model that could not be loaded
    (ATTEND_SKIP_BROKEN_MODELS): NOT_SERVING, as ServerReady and /health/ready say."""
    def statuses(address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            checked = [health.Check(health_pb2.HealthCheckRequest(service=s)).status
                       for s in ("", "inference.GRPCInferenceService")]
            listed = {k: v.status for k, v in health.List(health_pb2.HealthListRequest()).statuses.items()}
            assert listed == dict(zip(("", "inference.GRPCInferenceService"), checked, strict=True))
            assert _error(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope"))) == (
                grpc.StatusCode.NOT_FOUND,
                "no service 'nope' here: ask for '' (the server) or 'inference.GRPCInferenceService'")
        return checked

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses(server[1]) == [serving, serving]
    repo = shutil.copytree(repository, tmp_path / "repo")
    (repo / "dot_product" / "1" / "model.onnx").write_bytes(b"broken")
    port = free_port()
    with running_service(repo, ATTEND_GRPC_PORT=str(port), ATTEND_SKIP_BROKEN_MODELS="true",
                         ATTEND_INTRA_OP_THREADS="1", ready_path="/health/live") as (url, _):
        assert httpx.get(f"{url}/health/ready").status_code == 503
        assert not grpcclient.InferenceServerClient(f"127.0.0.1:{port}").is_server_ready()
        assert statuses(f"127.0.0.1:{port}") == [not_serving, not_serving]


def _watch(address, service=""):
    """A Watch in a thread: (queue of its statuses, then its end as (code, details); the call, to cancel)."""
    channel = grpc.insecure_channel(address)
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
    seen = queue.Queue()

    def read():
        try:
            for answer in call:
                seen.put(answer.status)
        except grpc.RpcError as e:
            seen.put((e.code(), e.details()))
        channel.close()

    threading.Thread(target=read, daemon=True).start()
    return seen, call


def test_grpc_health_watch_says_each_change_and_ends_at_sigterm(repository, tmp_path):
    """Watch (gRPC's client-side health checking): the status at once, then each change. A model that could not be
    loaded: NOT_SERVING; once it is loaded, SERVING within a second. An unknown service: SERVICE_UNKNOWN, and
    the stream stays open. A channel with gRPC's client-side health checking sends no call until SERVING.
    Watches are streams (ATTEND_MAX_OPEN_CONNECTIONS=3: a fourth is refused). SIGTERM:
    NOT_SERVING at once, then the stream ends UNAVAILABLE, and the process exits."""
    repo = shutil.copytree(repository, tmp_path / "repo")
    model = repo / "dot_product" / "1" / "model.onnx"
    good = model.read_bytes()
    model.write_bytes(b"broken")
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path / "service.log"
    with running_service(repo, ATTEND_GRPC_PORT=str(port), ATTEND_SKIP_BROKEN_MODELS="true", ATTEND_ADMIN_KEYS=ADMIN,
                         ATTEND_MAX_OPEN_CONNECTIONS="3", ATTEND_INTRA_OP_THREADS="1", ATTEND_LOG_LEVEL="info",
                         log_path=log, ready_path="/health/live") as (url, proc):
        watched, _ = _watch(address)
        assert watched.get(timeout=10) == health_pb2.HealthCheckResponse.NOT_SERVING
        unknown, unknown_call = _watch(address, "nope")
        assert unknown.get(timeout=10) == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        # gRPC's client-side health checking (the channel's own Watch): no call goes to a replica not SERVING.
        config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})
        checked = grpc.insecure_channel(address, options=[("grpc.service_config", config)])
        live = functools.partial(pb_grpc.GRPCInferenceServiceStub(checked).ServerLive, pb.ServerLiveRequest(),
                                 timeout=5)
        code, details = _error(live)
        assert code == grpc.StatusCode.UNAVAILABLE and "backend unhealthy" in details
        refused, _ = _watch(address)  # a fourth stream
        assert refused.get(timeout=10) == (grpc.StatusCode.UNAVAILABLE,
                                           "3 streams are open (ATTEND_MAX_OPEN_CONNECTIONS); retry shortly")
        model.write_bytes(good)
        assert httpx.post(f"{url}/v2/repository/models/dot_product/load",
                          headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
        loaded = time.monotonic()
        assert watched.get(timeout=10) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - loaded < 1.5  # within _WATCH_S (0.5 s) of the load, with room for a busy core
        assert watched.empty() and unknown.empty()  # nothing changed for either since
        assert live(wait_for_ready=True).live  # once the channel's own Watch has seen SERVING too
        checked.close()
        unknown_call.cancel()
        assert unknown.get(timeout=10)[0] == grpc.StatusCode.CANCELLED
        # The server learns of the cancel a moment later: a SIGTERM before it would end that stream 503.
        cancelled = time.monotonic() + 10
        while not re.search(r"GRPC Watch 499 \d+\.\dms", log.read_text()) and time.monotonic() < cancelled:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert watched.get(timeout=10) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert watched.get(timeout=10) == (grpc.StatusCode.UNAVAILABLE,
                                           "the service is stopping; watch another replica")
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    lines = log.read_text()
    assert re.search(r"GRPC Watch 499 \d+\.\dms", lines) and re.search(r"GRPC Watch 503 \d+\.\dms", lines), lines


def test_keys_and_model_control(repository):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_API_KEYS=KEY, ATTEND_ADMIN_KEYS=ADMIN,
                         ATTEND_INTRA_OP_THREADS="1") as (url, _):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        keyed = {"authorization": f"Bearer {KEY}"}
        admin = {"authorization": f"Bearer {ADMIN}"}
        inputs = _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1])
        assert client.is_server_live() and client.is_server_ready()  # open, as HTTP's probes
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
        for call in (lambda h: client.infer("additive", inputs, headers=h),
                     lambda h: client.get_model_metadata("additive", headers=h),
                     lambda h: client.get_server_metadata(headers=h),
                     lambda h: client.get_inference_statistics("additive", headers=h)):
            for headers in (None, {"authorization": "Bearer wrong"}):
                with pytest.raises(InferenceServerException) as error:
                    call(headers)
                assert error.value.status() == "StatusCode.UNAUTHENTICATED"
            assert call(keyed) is not None
        np.testing.assert_allclose(client.infer("additive", inputs, headers=keyed).as_numpy("outputs"),
                                   BOOK_OUTPUTS, rtol=1e-6)
        assert "model_repository" in client.get_server_metadata(headers=keyed).extensions
        # Model control: the admin key, not the API key.
        with pytest.raises(InferenceServerException) as error:
            client.unload_model("additive", headers=keyed)
        assert error.value.status() == "StatusCode.UNAUTHENTICATED"
        index = client.get_model_repository_index(headers=admin).models
        assert {(m.name, m.version, m.state) for m in index} == {(k, "1", "READY") for k in KINDS}
        client.unload_model("additive", headers=admin)
        with pytest.raises(InferenceServerException) as error:
            client.infer("additive", inputs, headers=keyed)
        assert error.value.status() == "StatusCode.NOT_FOUND"
        assert not client.is_model_ready("additive", headers=keyed)
        ready = client.get_model_repository_index(headers=admin, as_json=True)
        assert "additive" not in {m["name"] for m in ready["models"] if m.get("state") == "READY"}
        client.load_model("additive", headers=admin)
        np.testing.assert_allclose(client.infer("additive", inputs, headers=keyed).as_numpy("outputs"),
                                   BOOK_OUTPUTS, rtol=1e-6)
        with pytest.raises(InferenceServerException) as error:
            client.load_model("../etc", headers=admin)
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert httpx.get(f"{url}/health/live").status_code == 200


def test_off_with_port_zero_and_a_taken_port_stops_the_start(repository, tmp_path):
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_GRPC_PORT="0", ATTEND_LOG_LEVEL="info") as (url, _):
        assert httpx.get(f"{url}/v2").status_code == 200
    text = log.read_text()
    assert "ready: 6 models" in text and "gRPC" not in text
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cpu", "ATTEND_PORT": str(free_port()),
               "ATTEND_GRPC_PORT": str(port), "PATH": "/usr/bin:/bin"}
        result = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1
    assert f"cannot start: cannot serve gRPC on 127.0.0.1:{port} (ATTEND_GRPC_PORT): Address already in use" \
        in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    same = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env | {"ATTEND_GRPC_PORT": env["ATTEND_PORT"]})
    assert same.returncode == 1 and same.stderr.startswith("cannot start: ATTEND_GRPC_PORT: Value error, must differ "
                                                           "from ATTEND_PORT"), same.stderr


def _slow_call(port, channel_args=None):
    """A client, the inputs of a dot-product call that runs for a while (3 x 4096 x 4096 scores, a 9 MB
    message), its outputs, and how long it took warm (its runs go to an inference thread from then on)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}", channel_args=channel_args)
    q = np.random.default_rng(4).normal(size=(3, 4096, 64)).astype(np.float32)
    inputs = []
    for name in ("queries", "keys", "values"):
        tensor = grpcclient.InferInput(name, list(q.shape), "FP32")
        tensor.set_data_from_numpy(q)
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput("outputs")]
    for _ in range(2):  # the second run's time: the first pays for its size's first run
        start = time.perf_counter()
        result = client.infer("dot_product", inputs, outputs=outputs)
        alone = time.perf_counter() - start
    np.testing.assert_allclose(result.as_numpy("outputs")[0, :2], _attention(q[0, :2], q[0], q[0]), rtol=1e-4,
                               atol=1e-5)
    assert alone > 0.1, f"the slow call took {alone:.3f}s: too short to act during it"
    return client, inputs, outputs, alone, q


def _stream(client, headers=None):
    """tritonclient's stream on `client`: a queue of its callback's (result, error)."""
    answers = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
    return answers


def _in_flight(url):
    """attend_requests_in_flight: requests admitted and not yet answered."""
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines()
                if x.startswith("attend_requests_in_flight "))
    return float(line.split()[-1])


def _grpc_count(url, status, family="attend_requests_total"):
    metrics = httpx.get(f"{url}/metrics").text
    line = f'{family}{{model="dot_product",protocol="grpc",status="{status}"}} '
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


def test_a_cancelled_call_counts_as_gone_and_a_passed_deadline_as_504(repository):
    port = free_port()
    # Slow calls in flight at once: room for all in the in-flight budget (~1 GB counted each), and a batch of
    # one call's 3 rows at most and one inference thread (so that each waits in the queue: not merged into
    # another's run, nor run beside it). No batch runs on the event loop (ATTEND_INLINE_RUN_US=0): the small
    # call below, predicted short, would otherwise run there as soon as the batcher took it, ahead of the last
    # slow call.
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_MAX_WEIGHT_ELEMENTS=str(64 << 20), ATTEND_MAX_INFLIGHT_BYTES=str(32 << 30),
                         ATTEND_MAX_BATCH_ROWS="3", ATTEND_INFERENCE_THREADS="1", ATTEND_INLINE_RUN_US="0",
                         ATTEND_ALONE_INLINE_RUN_US="0") as (url, _):
        client, inputs, outputs, alone, q = _slow_call(port)
        # Slow calls that run for `alone` each, one after the other, and a small one behind them, waiting
        # for the inference thread: cancelled once it is admitted (cancelled at a guessed time, it raced its
        # run's end, which now and then came first). Small, so that it is taken in at once: a third slow
        # call's 9 MB message now and then took longer to come in, on a busy machine, than the runs ahead of
        # it. As many slow calls as make 2 s of runs on this machine now (3 to 8): seeing the small call
        # admitted took up to 0.6 s of scrapes with a core kept busy, so its wait holds that 3 times.
        ahead = [threading.Event() for _ in range(min(8, max(3, math.ceil(2.0 / alone))))]
        done = threading.Event()
        answered = _grpc_count(url, 200)  # the warm-up's

        def admitted() -> float:
            """The calls taken in since: in flight now, or answered already (the first slow call can end
            before the third's message is all in, on a busy machine)."""
            return _in_flight(url) + _grpc_count(url, 200) - answered

        def wait_for(calls: int) -> None:
            waiting = time.monotonic() + 10
            while admitted() < calls and not ahead[-1].is_set() and time.monotonic() < waiting:
                # Not every 2 ms: each scrape takes the service's event loop for a while, the loop that is
                # taking in the messages.
                time.sleep(0.02)
            assert not ahead[-1].is_set(), f"the calls ahead ended before call {calls} was admitted"

        for event in ahead:
            client.async_infer("dot_product", inputs, lambda result, error, event=event: event.set(),
                               outputs=outputs)
        wait_for(len(ahead))  # the slow calls all in: the small one queues behind the last of them
        small = []
        for name in ("queries", "keys", "values"):
            small.append(grpcclient.InferInput(name, [1, 4, 8], "FP32"))
            small[-1].set_data_from_numpy(np.ones((1, 4, 8), np.float32))
        call = client.async_infer("dot_product", small, lambda result, error: done.set(), outputs=outputs)
        wait_for(len(ahead) + 1)
        call.cancel()
        assert done.wait(10) and all(event.wait(30) for event in ahead)
        deadline = time.monotonic() + 10  # the server learns of it from the stream's reset
        while _grpc_count(url, 499) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _grpc_count(url, 499) == 1, [x for x in httpx.get(f"{url}/metrics").text.splitlines()
                                            if "attend_requests_total" in x and 'protocol="grpc"' in x]
        assert 'attend_client_gone_total{model="dot_product"} 1.0' in httpx.get(f"{url}/metrics").text
        # The service's own deadline, asked for in metadata, and as Triton's `timeout` parameter (microseconds;
        # tritonclient's `timeout`), over gRPC, its stream and HTTP: the call ends while its batch runs.
        with pytest.raises(InferenceServerException) as error:
            client.infer("dot_product", inputs, outputs=outputs, headers={"x-request-timeout-ms": "30"})
        assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "deadline passed" in error.value.message()
        with pytest.raises(InferenceServerException) as error:
            client.infer("dot_product", inputs, outputs=outputs, timeout=30_000)
        assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "deadline passed" in error.value.message()
        answers = _stream(client)
        client.async_stream_infer("dot_product", inputs, outputs=outputs, timeout=30_000)
        result, error = answers.get(timeout=30)
        client.stop_stream()
        assert result is None and "deadline passed" in error.message()
        assert _grpc_count(url, 504) == 3
        http_inputs = [httpclient.InferInput(name, list(q.shape), "FP32") for name in ("queries", "keys", "values")]
        for tensor in http_inputs:
            tensor.set_data_from_numpy(q, binary_data=True)
        with pytest.raises(InferenceServerException) as error:
            httpclient.InferenceServerClient(url.removeprefix("http://")).infer(
                "dot_product", http_inputs, outputs=[httpclient.InferRequestedOutput("outputs")], timeout=30_000)
        assert error.value.status() == "504" and "deadline passed" in error.value.message()
        stats = client.get_inference_statistics("dot_product", as_json=True)["model_stats"][0]["inference_stats"]
        assert int(stats["fail"]["count"]) == 5 and int(stats["success"]["count"]) == 2 + len(ahead)


def test_sigterm_drains_a_call_in_flight(repository):
    """A call under way when SIGTERM comes is answered; a new one is refused; the process exits 0. Before
    the signal, a second call at once is over ATTEND_MAX_CONNECTIONS (1): UNAVAILABLE."""
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_MAX_WEIGHT_ELEMENTS=str(64 << 20), ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30),
                         ATTEND_MAX_CONNECTIONS="1") as (url, proc):
        client, inputs, outputs, _, q = _slow_call(port)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.infer, "dot_product", inputs, outputs=outputs)
            # Until the call is admitted (counted under way from its start): a guessed sleep of alone / 3 now
            # and then ended before its 9 MB message began, on a busy machine, and the second call went first.
            waiting = time.monotonic() + 10
            while _in_flight(url) < 1 and not call.done() and time.monotonic() < waiting:
                time.sleep(0.01)
            assert not call.done(), "the slow call ended before it was seen admitted"
            with pytest.raises(InferenceServerException) as error:
                client.infer("dot_product", inputs, outputs=outputs)
            # As HTTP's 503 past ATTEND_MAX_CONNECTIONS: UNAVAILABLE, to retry (service.grpc.guard).
            assert error.value.status() == "StatusCode.UNAVAILABLE"
            assert "1 calls are under way (ATTEND_MAX_CONNECTIONS)" in error.value.message()
            assert not call.done()
            proc.send_signal(signal.SIGTERM)
            result = call.result(timeout=60)
        np.testing.assert_allclose(result.as_numpy("outputs")[0, :2], _attention(q[0, :2], q[0], q[0]), rtol=1e-4,
                                   atol=1e-5)
        with pytest.raises(InferenceServerException) as error:
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}").infer("dot_product", inputs, outputs=outputs)
        assert error.value.status() == "StatusCode.UNAVAILABLE"
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


class _SlowRelay:
    """A TCP relay on 127.0.0.1 to `target`, with a small receive buffer towards the server. Once `stall_after`
    bytes of the server's have passed, it stops reading them for a second: the rest of an answer waits in the
    server's send queue, as it does for a client slower to read than the server to write. Halfway through,
    it sends the server what such a client sends as it reads: a WINDOW_UPDATE (on the connection, of 1)."""

    WINDOW_UPDATE = (4).to_bytes(3, "big") + bytes([0x8, 0]) + (0).to_bytes(4, "big") + (1).to_bytes(4, "big")

    def __init__(self, target: int):
        self.target, self.passed, self.stall_after = target, 0, None
        self.sending = threading.Lock()  # the frame goes between two chunks of the client's, not into one
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.socket()
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # before connect: TCP's window
            server.connect(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(16384):
                with self.sending:
                    sink.sendall(data)
                if answers:
                    self.passed += len(data)
                    if self.stall_after is not None and self.passed >= self.stall_after:
                        self.stall_after = None
                        time.sleep(0.5)
                        with self.sending:
                            source.sendall(self.WINDOW_UPDATE)
                        time.sleep(0.5)
        except OSError:  # the server reset the connection: what it had not sent is lost
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_sigterm_delivers_an_answer_a_slow_client_still_reads(repository):
    """A 3 MB answer that a client reads slowly, SIGTERM while it is computed: it arrives whole. grpc's own stop
    closed the connection once the answer was in the kernel's send queue, and the client's next frame made
    the kernel reset it (UNAVAILABLE, "Server shutdown")."""
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_MAX_WEIGHT_ELEMENTS=str(64 << 20),
                         ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30)) as (url, proc):
        relay = _SlowRelay(port)
        try:
            # A stream window (HTTP/2 flow control) larger than the answer: grpc writes all of it at once.
            client, inputs, outputs, _, q = _slow_call(relay.port, [("grpc.http2.lookahead_bytes", 16 << 20)])
            with ThreadPoolExecutor(1) as pool:
                relay.stall_after = relay.passed + 65536  # in the answer's first 64 KiB
                call = pool.submit(client.infer, "dot_product", inputs, outputs=outputs)
                waiting = time.monotonic() + 30
                while not _in_flight(url) and time.monotonic() < waiting:  # taken in: SIGTERM while it runs
                    time.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                result = call.result(timeout=60)
            assert result.as_numpy("outputs").shape == q.shape
            np.testing.assert_allclose(result.as_numpy("outputs")[0, :2], _attention(q[0, :2], q[0], q[0]),
                                       rtol=1e-4, atol=1e-5)
            assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        finally:
            relay.listener.close()


def _attention(q, k, v):
    """Scaled dot-product attention, the book's formula, for a few queries."""
    scores = q @ k.T / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def test_workers_serve_grpc_on_one_port(repository):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port), ATTEND_WORKERS="2",
                         ATTEND_INTRA_OP_THREADS="1") as (url, _):
        inputs = _inputs(grpcclient, _arrays(json.dumps(toy_request()).encode())[1])
        for _ in range(8):  # a new connection each: the kernel spreads them over both workers
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            np.testing.assert_allclose(client.infer("additive", inputs).as_numpy("outputs"), BOOK_OUTPUTS,
                                       rtol=1e-6)
            client.close()
        metrics = httpx.get(f"{url}/metrics").text
        assert 'attend_requests_total{model="additive",protocol="grpc",status="200"} 8.0' in metrics


def test_grpcios_error_for_an_answer_not_sent_is_one_warning_line():
    """grpcio logs "ExecuteBatchError raised in core by servicer method [...]" at ERROR with its traceback
    when it cannot write a call's answer: the client closed the call, or refused a message over its limit
    (seen with a default client and the 16 MB weights of 1 x 2048 x 2048, once a process, and not every
    time: hence a record here rather than a real call). Through grpcio's own logger and the service's
    format, it is one warning line naming the method."""
    import logging

    from grpc._cython.cygrpc import ExecuteBatchError

    import service.grpc.server  # noqa: F401  (puts the filter on grpcio's logger)
    from service.core.logs import _Formatter

    logger = logging.getLogger("grpc._cython.cygrpc")
    try:
        raise ExecuteBatchError("Failed \"execute_batch\": (<SendMessageOperation>,)")
    except ExecuteBatchError:
        method = "servicer method [/inference.GRPCInferenceService/ModelInfer]"
        record = logger.makeRecord(logger.name, logging.ERROR, "server.pyx.pxi", 710, "%s raised in core by %s",
                                   ("ExecuteBatchError", method), sys.exc_info())
    assert logger.filter(record)
    line = _Formatter().format(record)
    assert record.levelno == logging.WARNING and "\n" not in line and "Traceback" not in line, line
    assert line.endswith(f"WARNING grpc._cython.cygrpc [-] {method}: the answer could not be sent (the client "
                         "closed the call, or its message limit refused the answer)"), line
    other = logger.makeRecord(logger.name, logging.ERROR, "x", 1, "something else", (), None)
    assert logger.filter(other) and other.levelno == logging.ERROR and other.getMessage() == "something else"
