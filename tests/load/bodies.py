"""Worst-case request bodies, one a form a body can take, for each protocol: what a hostile (or careless)
client can send within the body limit. tests/service/test_bounded.py sends them to the real process
(statuses, the event loop's gaps, memory); tests/load/membound.py measures what each costs.

Each generator takes a size in bytes (the body's, before compression) and returns a `Body`: the bytes on
the wire, the path, the headers, and the statuses the service may answer it with.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field

import numpy as np

ATTEND = "/attend"
INFER = "/v2/models/dot_product/infer"
GRPC = "ModelInfer"  # a gRPC call's: the body is its message


@dataclass
class Body:
    name: str
    path: str
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)
    statuses: tuple[int, ...] = (200,)  # what the service may answer (with default limits, alone)

    @property
    def wire(self) -> int:
        return len(self.content)


def _rows(n_rows: int, row: str) -> str:
    return "[" + ",".join([row] * n_rows) + "]"


# Shapes within the default limits (batch <= 1024; batch x n_q x n_k <= 4M weights), so that a large body
# is decoded and run whole: batch items of 32 x 256, as many as the size allows.
N, D = 32, 256


def _batch(size: int, bytes_per_number: float) -> int:
    return max(1, min(1024, int(size / (3 * N * D * bytes_per_number))))


def _attend(queries: str, keys: str, values: str) -> bytes:
    return f'{{"model":"dot_product","queries":{queries},"keys":{keys},"values":{values}}}'.encode()


def json_long(size: int) -> Body:
    """Long decimals (json.dumps of float32 tensors, ~20 bytes a number): what clients usually send."""
    rng = np.random.default_rng(0)
    a = json.dumps(rng.normal(size=(_batch(size, 20), N, D)).astype(np.float32).tolist())
    return Body("JSON, long decimals", ATTEND, _attend(a, a, a), {"content-type": "application/json"}, (200, 413))


def json_dense(size: int) -> Body:
    """As many numbers as bytes allow: '0,' (2 bytes a number)."""
    arr = _rows(_batch(size, 2), _rows(N, "[" + ",".join(["0"] * D) + "]"))
    return Body("JSON, dense ('0,0,...')", ATTEND, _attend(arr, arr, arr), {"content-type": "application/json"},
                (200, 413))


def json_arrays(size: int) -> Body:
    """An array a number ('[0],', 4 bytes a number): the most JSON arrays a body can hold."""
    per_row = 1000
    one = _rows(per_row, "[0]")
    batch = max(1, min(1024, size // (3 * 4 * per_row)))
    arr = _rows(batch, one)
    return Body("JSON, an array a number ('[[0],[0],...]')", ATTEND, _attend(arr, arr, arr),
                {"content-type": "application/json"}, (200, 413))


def json_nested(size: int) -> Body:
    """Arrays nested as deep as the body allows ('[[[[...]]]]')."""
    depth = max(1, size // 2)
    return Body("JSON, nested arrays", ATTEND, b'{"queries":' + b"[" * depth + b"]" * depth + b"}",
                {"content-type": "application/json"}, (400, 413, 422))


def json_escaped(size: int) -> Body:
    """One long string of escapes ('\\u0000' six bytes each) where the model's name belongs."""
    count = max(1, size // 6)
    return Body("JSON, a string of escapes", ATTEND, b'{"model":"' + b"\\u0000" * count + b'"}',
                {"content-type": "application/json"}, (400, 404, 413, 422))


def compressed(body: Body, encoding: str = "gzip") -> Body:
    """`body` compressed (gzip or deflate): the same form, inflated by the service."""
    content = gzip.compress(body.content, 6) if encoding == "gzip" else zlib.compress(body.content, 6)
    return Body(f"{body.name}, {encoding}", body.path, content, body.headers | {"content-encoding": encoding},
                tuple(sorted({*body.statuses, 413})))


def v2_json_dense(size: int) -> Body:
    """The Open Inference Protocol with JSON tensors, flat data of '0,' (2 bytes a number)."""
    shape = [_batch(size, 2), N, D]
    data = "[" + ",".join(["0"] * (shape[0] * N * D)) + "]"
    inputs = ",".join(f'{{"name":"{name}","datatype":"FP32","shape":{json.dumps(shape)},"data":{data}}}'
                      for name in ("queries", "keys", "values"))
    return Body("OIP JSON, dense", INFER, f'{{"inputs":[{inputs}]}}'.encode(), {"content-type": "application/json"},
                (200, 413))


def _binary(shape: list[int], datatype: str, stated: int | None = None, extra: bytes = b"",
            random: bool = False) -> tuple[bytes, dict]:
    dtype = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64}[datatype]
    tensor = (np.random.default_rng(0).normal(size=shape) if random else np.zeros(shape)).astype(dtype).tobytes()
    size = len(tensor) if stated is None else stated
    head = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "parameters": {"binary_data_size": size}}
                                  for name in ("queries", "keys", "values")]}).encode()
    return head + tensor * 3 + extra, {"inference-header-content-length": str(len(head)),
                                       "content-type": "application/octet-stream"}


def v2_binary(size: int, datatype: str = "FP32", random: bool = False) -> Body:
    """Binary tensors (FP16 is cast to float32: twice its bytes); zeros, or `random` normal numbers."""
    itemsize = {"FP32": 4, "FP16": 2, "FP64": 8}[datatype]
    content, headers = _binary([_batch(size, itemsize), N, D], datatype, random=random)
    return Body(f"OIP binary {datatype}", INFER, content, headers, (200, 413))


def v2_binary_lying(size: int) -> Body:
    """Binary tensors whose stated binary_data_size is far beyond the body."""
    content, headers = _binary([_batch(size, 4), N, D], "FP32", stated=1 << 40)
    return Body("OIP binary, sizes that lie", INFER, content, headers, (400,))


def v2_header_lying(size: int) -> Body:
    """An Inference-Header-Content-Length beyond the body."""
    content, headers = _binary([_batch(size, 4), N, D], "FP32")
    return Body("OIP binary, a header length that lies", INFER, content,
                headers | {"inference-header-content-length": str(len(content) + 1)}, (400,))


def grpc_forms(size: int) -> list[Body]:
    """ModelInfer's messages: raw_input_contents (misaligned in the message: an id of 1 byte), and typed
    contents (fp32_contents). Built with the service's own stubs, imported here: a test process that imports
    tritonclient's would register the same proto files twice."""
    from service.grpc.proto import grpc_service_pb2 as pb

    shape = [_batch(size, 4), N, D]
    tensor = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    raw, typed = pb.ModelInferRequest(model_name="dot_product", id="r"), pb.ModelInferRequest(model_name="dot_product")
    for name in ("queries", "keys", "values"):
        raw.inputs.add(name=name, datatype="FP32", shape=shape)
        raw.raw_input_contents.append(tensor.tobytes())
        typed.inputs.add(name=name, datatype="FP32", shape=shape).contents.fp32_contents.extend(tensor.ravel())
    # The same typed contents, each tensor's in 64 runs (contents fields protobuf merges): the decode joins them.
    runs = pb.ModelInferRequest(model_name="dot_product").SerializeToString()
    inputs = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["inputs"].number
    contents = pb.ModelInferRequest.InferInputTensor.DESCRIPTOR.fields_by_name["contents"].number
    for name in ("queries", "keys", "values"):
        parts = [pb.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=shape).SerializeToString()]
        parts += [proto_field(contents, pb.InferTensorContents(fp32_contents=run).SerializeToString())
                  for run in np.array_split(tensor.ravel(), 64)]
        runs += proto_field(inputs, b"".join(parts))
    return [Body("gRPC, raw_input_contents", GRPC, raw.SerializeToString(), statuses=(200, 413)),
            Body("gRPC, typed contents", GRPC, typed.SerializeToString(), statuses=(200, 413)),
            Body("gRPC, typed contents in 64 runs", GRPC, runs, statuses=(200, 413))]


def proto_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field, as protobuf writes it."""
    from service.grpc.wire import varint

    return varint(number << 3 | 2) + varint(len(value)) + value


def every_form(size: int) -> list[Body]:
    """One body of each form, about `size` bytes before compression."""
    return [json_long(size), json_dense(size), json_arrays(size), json_nested(size), json_escaped(size),
            compressed(json_long(size)), compressed(json_dense(size)), compressed(json_dense(size), "deflate"),
            v2_json_dense(size), v2_binary(size), v2_binary(size, "FP16"), compressed(v2_binary(size)),
            v2_binary_lying(size), v2_header_lying(size)]


def _filled(size: int, head: str, item: str, tail: str) -> bytes:
    """`head`, then `item` (with {i} the item's number) as many times as `size` allows, comma-separated."""
    items, total, i = [], len(head) + len(tail), 0
    while total < size:
        items.append(item.format(i=i))
        total += len(items[-1]) + 1
        i += 1
    return (head + ",".join(items) + tail).encode()


_QUERIES = '{"name":"queries","datatype":"FP32","shape":[1,1,2],"data":[1,2]'


def many_values(size: int) -> list[Body]:
    """Bodies of many keys or values where a request has a few (a refusal each, once it is seen): simdjson
    finds a key by reading the keys before it, and makes a container Python objects holding the GIL."""
    json_type = {"content-type": "application/json"}
    return [
        Body("JSON, many keys", ATTEND, _filled(size, '{"model":"dot_product",', '"k{i}":0', "}"), json_type, (422,)),
        Body("OIP JSON, many parameters", INFER, _filled(size, '{"inputs":[],"parameters":{', '"k{i}":0', "}}"),
             json_type, (400,)),
        Body("OIP JSON, an input of many keys", INFER, _filled(size, '{"inputs":[' + _QUERIES + ",", '"k{i}":0', "}]}"),
             json_type, (400,)),
        Body("OIP JSON, a shape of many dimensions", INFER,
             _filled(size, '{"inputs":[{"name":"queries","datatype":"FP32","shape":[', "1", "]}]}"), json_type, (400,)),
        Body("OIP JSON, many outputs", INFER, _filled(size, '{"inputs":[' + _QUERIES + '}],"outputs":[', "{{}}", "]}"),
             json_type, (400,)),
    ]
