"""Mutated good bodies against a real server: every value swapped for one of another type, keys dropped or added,
values wrapped, lists grown, through /attend and the Open Inference Protocol (JSON and binary), some padded past
1 MiB (a decode process reads those); and over gRPC, messages whose names, datatypes, shapes, parameters and
contents (raw or typed, of any type) are changed. No answer is a 5xx (or gRPC's INTERNAL or UNKNOWN), every
refusal is the protocol's error body, and the log holds no traceback, no warning and no failed decode process.
(It found a datatype sent as a list: a 500.)

The gRPC messages are built with the stubs tritonclient ships, as in test_grpc."""

import copy
import json
import os
import random

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.server import free_port, running_service
from tests.service.test_batching import make_body
from tests.service.test_json_process import padded

pytestmark = pytest.mark.slow

# CI replays fixed cases; FUZZ_EXAMPLES=20000 FUZZ_RANDOM=1 explores new ones.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "600"))
SEED = random.randrange(1 << 30) if os.environ.get("FUZZ_RANDOM") else 0
KINDS = ("additive", "dot_product", "multi_head", "masked_softmax", "self_attention", "positional_encoding")
VALUES = (None, True, False, 0, 1, -1, 7, 1.5, -0.0, 1e39, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
          1e-45, "", "x", "FP32", "INT64", "FP16", "BYTES", "\u0000", "é", "a" * 300, [], {}, [1], [[1]], [1.5, "x"],
          {"a": 1}, {"binary_data_size": 4}, [None], [[[]]], {"": None}, ["FP32"], [2, 1, 20], [-1], [2**40, 2**40],
          {"name": "queries"})
KEYS = ("extra", "name", "parameters", "shape", "datatype", "data", "id", "outputs", "binary_data", "timeout",
        "valid_lens", "return_weights", "model", "classification")


def _places(node, at=()):
    yield at
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _places(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:6]):
            yield from _places(value, (*at, i))


def mutated(rng: random.Random, body):
    """`body` with one to three changes at random places."""
    body = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        at = rng.choice(list(_places(body)))
        if not at:
            continue
        parent = body
        for key in at[:-1]:
            parent = parent[key]
        key, roll = at[-1], rng.random()
        if roll < 0.55:
            parent[key] = copy.deepcopy(rng.choice(VALUES))
        elif roll < 0.7:
            del parent[key]
        elif roll < 0.8 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice(VALUES))
        elif roll < 0.9:
            parent[key] = [parent[key]]
        elif isinstance(parent[key], list) and parent[key]:
            parent[key] = parent[key] + parent[key][:1]
        else:
            parent[key] = {"x": parent[key]}
    return body


def _as_protocol(body: dict) -> tuple[str, dict]:
    inputs = [{"name": name, "datatype": "INT64" if name == "valid_lens" else "FP32",
               "shape": list(np.shape(body[name])), "data": np.ravel(body[name]).tolist()}
              for name in ("queries", "keys", "values", "scores", "valid_lens") if body.get(name) is not None]
    outputs = [{"name": "outputs"}] if body.get("return_weights") is False else []
    return body["model"], {"id": "a", "parameters": {"timeout": 10**9}, "inputs": inputs, "outputs": outputs}


def _binary(head) -> tuple[bytes, dict]:
    """`head`'s inputs' data moved after it as binary tensors, where it is still an array of numbers."""
    blobs = []
    for entry in head.get("inputs", []) if isinstance(head, dict) and isinstance(head.get("inputs"), list) else []:
        if isinstance(entry, dict) and "data" in entry:
            data = entry.pop("data")
            try:
                blob = np.asarray(data, np.int64 if entry.get("datatype") == "INT64" else np.float32).tobytes()
            except (TypeError, ValueError, OverflowError):
                blob = b"\0" * 12
            if isinstance(entry.setdefault("parameters", {}), dict):
                entry["parameters"]["binary_data_size"] = len(blob)
            blobs.append(blob)
    text = json.dumps(head).encode()
    return text + b"".join(blobs), {"Inference-Header-Content-Length": str(len(text))}


def cases(count: int, seed: int):
    """(form, path, body, headers): mutated /attend, protocol JSON and protocol binary bodies of every model and
    form of lengths; one in six padded past 1 MiB."""
    numbers = np.random.default_rng(5)
    goods = [json.loads(make_body(kind, numbers, batch, 2, 3, form)) | ({"return_weights": False} if batch == 1 else {})
             for kind in KINDS for form in ("absent", "1d", "2d") for batch in (1, 2)]
    rng = random.Random(seed)
    for i in range(count):
        good, form = rng.choice(goods), ("attend", "json", "binary")[i % 3]
        if form == "attend":
            path, (body, headers) = "/attend", (json.dumps(mutated(rng, good)).encode(), {})
        else:
            model, head = _as_protocol(good)
            head = mutated(rng, head)
            path = f"/v2/models/{model}/infer"
            body, headers = _binary(head) if form == "binary" else (json.dumps(head).encode(), {})
        if rng.random() < 1 / 6:
            body, headers = padded(body, headers)
        yield form, path, body, headers | {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    """(URL, gRPC address, log) of one service with a decode process; at the end, its log is clean."""
    log, port = tmp_path_factory.mktemp("mutations") / "service.log", free_port()
    with running_service(repository, log_path=log, ATTEND_JSON_PROCESSES="1", ATTEND_GRPC_PORT=str(port),
                         ATTEND_LOG_LEVEL="info") as (url, _):
        yield url, f"127.0.0.1:{port}"
    text = log.read_text()
    for sign in ("Traceback", "Warning", "decode process failed", "reader raised", " 500 "):
        assert sign not in text, (SEED, text[-3000:])


def test_mutated_bodies_get_answers_or_readable_refusals(server):
    url, _ = server
    seen = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for form, path, body, headers in cases(EXAMPLES, SEED):
            answer = client.post(path, content=body, headers=headers)
            code = answer.status_code
            seen[form, code // 100] = seen.get((form, code // 100), 0) + 1
            late = code == 504 and "deadline passed" in answer.text  # a timeout parameter of a few us
            assert code < 500 or late, (SEED, path, body[:400], answer.text)
            if code >= 400:
                error = answer.json()["error"]
                message = error if path.startswith("/v2") else error["message"]
                assert isinstance(message, str) and message, answer.text
    # Both answers and refusals, through every form: the mutations do not all break a body the same way.
    forms = ("attend", "json", "binary")
    assert all(seen.get((form, kind), 0) > EXAMPLES / 100 for form in forms for kind in (2, 4)), seen


DATATYPES = ("FP32", "INT64", "FP16", "FP64", "INT32", "BYTES", "BOOL", "", "x", "UINT8", "BF16")
NAMES = ("queries", "keys", "values", "valid_lens", "scores", "", "outputs", "x" * 300, "\u0000")
SHAPES = ([], [-1], [0], [2**40, 2**40], [1] * 70, [2, -3, 4], [2**62, 4])
PARAMETERS = ("binary_data_size", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
              "classification", "binary_data", "timeout", "priority", "x")
CONTENTS = ("int_contents", "int64_contents", "uint_contents", "uint64_contents", "fp32_contents", "fp64_contents",
            "bool_contents", "bytes_contents")


def _parameter(rng: random.Random, parameters) -> None:
    choice = parameters[rng.choice(PARAMETERS)]
    field, value = rng.choice((("bool_param", True), ("int64_param", rng.choice((0, -1, 7, 2**62, -2**63))),
                               ("string_param", rng.choice(("", "x", "a" * 300))),
                               ("double_param", rng.choice((1.5, float("inf"), float("nan")))),
                               ("uint64_param", rng.choice((0, 7, 2**64 - 1)))))
    setattr(choice, field, value)


def _typed(contents, field: str, flat: np.ndarray) -> None:
    values = getattr(contents, field)
    if field == "bool_contents":
        values.extend(bool(x) for x in flat)
    elif field == "bytes_contents":
        values.extend([b"1"] * flat.size)
    elif field.startswith(("int", "uint")):  # within every integer type's range
        values.extend(int(min(abs(x), 2**31 - 1)) for x in flat)
    else:
        values.extend(float(x) for x in flat)


def grpc_message(rng: random.Random, good: dict) -> bytes:
    """A ModelInferRequest of `good`, each of its parts changed now and then."""
    request = pb.ModelInferRequest(model_name=good["model"] if rng.random() > 0.05 else rng.choice(KINDS + ("x",)))
    if rng.random() < 0.1:
        request.model_version = rng.choice(("1", "2", "-1", "x", "99999999999999999999"))
    raw = rng.random() < 0.6
    for name in ("queries", "keys", "values", "scores", "valid_lens"):
        if good.get(name) is None:
            continue
        flat = np.ravel(good[name])
        entry = request.inputs.add(name=name, datatype="INT64" if name == "valid_lens" else "FP32",
                                   shape=np.shape(good[name]))
        if rng.random() < 0.15:
            entry.name = rng.choice(NAMES)
        if rng.random() < 0.15:
            entry.datatype = rng.choice(DATATYPES)
        if rng.random() < 0.15:
            del entry.shape[:]
            entry.shape.extend(rng.choice((*SHAPES, [flat.size])))
        if rng.random() < 0.1:
            _parameter(rng, entry.parameters)
        if raw and rng.random() > 0.1:
            blob = flat.astype(np.int64 if name == "valid_lens" else np.float32).tobytes()
            request.raw_input_contents.append(blob[:rng.randrange(len(blob) + 1)] if rng.random() < 0.1 else blob)
        else:
            fields = ("int64_contents" if name == "valid_lens" else "fp32_contents",) * 4 + CONTENTS
            _typed(entry.contents, rng.choice(fields), flat)
    if rng.random() < 0.1 and request.inputs:
        request.inputs.add().CopyFrom(request.inputs[0])
    if rng.random() < 0.1 and request.inputs:
        del request.inputs[rng.randrange(len(request.inputs))]
    if rng.random() < 0.05:
        request.raw_input_contents.append(b"\0" * 12)
    if rng.random() < 0.2:
        output = request.outputs.add(name=rng.choice(("outputs", "attention_weights", "x", "")))
        if rng.random() < 0.3:
            _parameter(rng, output.parameters)
    if rng.random() < 0.1:
        _parameter(rng, request.parameters)
    return request.SerializeToString()


def test_mutated_grpc_messages_get_answers_or_readable_statuses(server):
    _, address = server
    numbers, rng = np.random.default_rng(5), random.Random(SEED)
    goods = [json.loads(make_body(kind, numbers, batch, 2, 3, form))
             for kind in KINDS for form in ("absent", "1d", "2d") for batch in (1, 2)]
    seen = {}
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(EXAMPLES):
            message = grpc_message(rng, rng.choice(goods))
            try:
                pb.ModelInferResponse.FromString(call(message, timeout=30))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and e.details(), (
                    SEED, code, e.details(), pb.ModelInferRequest.FromString(message))
            seen[code.name] = seen.get(code.name, 0) + 1
    assert seen.get("OK", 0) > EXAMPLES / 100 and seen.get("INVALID_ARGUMENT", 0) > EXAMPLES / 100, seen
