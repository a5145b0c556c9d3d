"""What `make bench` sends: a pool of bodies for each workload, and how each transport puts a body on
the wire.

A varied workload draws every body anew from a seeded RNG: its values, its valid-length form (absent,
1-D (batch) or 2-D (batch, n_q), a third each) and its shape, within ranges around the workload's
request; floats are written as `json.dumps` writes a float32 tensor's `.tolist()` (the shortest
double that round-trips, ~19 characters a number), as a client holding float32 tensors sends them.
A replayed workload is one body, sent again and again (what `make bench` measured before: every
request after the first takes the service's cached decode plan, and every batch is of equal shapes).

Rows of the benchmark are (workload, transport): `ROWS`. A transport turns a body (a dict of /attend's
fields) into (path, bytes, header length) and names the client that sends it (`client`: "wrk", the
HTTP/1.1 load generator of bench/pool.lua, or "grpc", bench/grpc_load.py's processes). The gRPC transport
writes each body as Triton's `ModelInferRequest` (tritonclient.grpc's own message, its tensors as
`raw_input_contents`), serialized once, here: the load generator sends bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Body = dict
SEED = 2025


def _floats(rng: np.random.Generator, *shape: int) -> list:
    return rng.normal(size=shape).astype(np.float32).tolist()


def _lens(rng: np.random.Generator, batch: int, n_q: int, n_k: int) -> list | None:
    """Absent, 1-D or 2-D valid lengths, a third each; lengths from 1 to n_k."""
    form = int(rng.integers(0, 3))
    if form == 0:
        return None
    return rng.integers(1, n_k + 1, size=(batch,) if form == 1 else (batch, n_q)).tolist()


def _sizes(rng: np.random.Generator, *ranges: tuple[int, int]) -> list[int]:
    return [int(rng.integers(low, high + 1)) for low, high in ranges]


def _with_lens(body: Body, lens: list | None) -> Body:
    return body if lens is None else body | {"valid_lens": lens}


def toy_additive(rng: np.random.Generator) -> Body:
    """additive (query size 20, key size 2), around the book's toy request (2 x 1 x 20, 2 x 10 keys, 4 values)."""
    b, n_q, n_k, v = _sizes(rng, (1, 4), (1, 4), (2, 12), (1, 8))
    return _with_lens({"model": "additive", "queries": _floats(rng, b, n_q, 20), "keys": _floats(rng, b, n_k, 2),
                       "values": _floats(rng, b, n_k, v)}, _lens(rng, b, n_q, n_k))


def large_dot_product(rng: np.random.Generator) -> Body:
    """dot_product around 8 x 128 queries x 128 keys x 64 features (2-4 MB of JSON)."""
    b, n_q, n_k = _sizes(rng, (4, 8), (64, 128), (64, 128))
    return _with_lens({"model": "dot_product", "queries": _floats(rng, b, n_q, 64), "keys": _floats(rng, b, n_k, 64),
                       "values": _floats(rng, b, n_k, 64)}, _lens(rng, b, n_q, n_k))


def multi_head(rng: np.random.Generator) -> Body:
    """multi_head (100 features, 5 heads), around the book's example (2 x 4 queries, 2 x 6 keys)."""
    b, n_q, n_k = _sizes(rng, (1, 4), (1, 8), (1, 8))
    return _with_lens({"model": "multi_head", "queries": _floats(rng, b, n_q, 100),
                       "keys": _floats(rng, b, n_k, 100), "values": _floats(rng, b, n_k, 100)},
                      _lens(rng, b, n_q, n_k))


def ragged_dot_product(rng: np.random.Generator) -> Body:
    """dot_product with every size drawn from 1 to 16 (batch, n_q, n_k, features, value size)."""
    b, n_q, n_k, d, v = _sizes(rng, (1, 16), (1, 16), (1, 16), (1, 16), (1, 16))
    return _with_lens({"model": "dot_product", "queries": _floats(rng, b, n_q, d), "keys": _floats(rng, b, n_k, d),
                       "values": _floats(rng, b, n_k, v)}, _lens(rng, b, n_q, n_k))


def self_attention(rng: np.random.Generator) -> Body:
    """self_attention (100 features, 5 heads, positional encoding): batch 1-4, n 1-16."""
    b, n = _sizes(rng, (1, 4), (1, 16))
    return _with_lens({"model": "self_attention", "queries": _floats(rng, b, n, 100)}, _lens(rng, b, n, n))


def masked_softmax(rng: np.random.Generator) -> Body:
    """masked_softmax of scores: batch 1-8, n_q and n_k 1-16."""
    b, n_q, n_k = _sizes(rng, (1, 8), (1, 16), (1, 16))
    return _with_lens({"model": "masked_softmax", "scores": _floats(rng, b, n_q, n_k)}, _lens(rng, b, n_q, n_k))


def positional_encoding(rng: np.random.Generator) -> Body:
    """positional_encoding of queries: batch 1-4, n 1-32, an even feature size 2-64."""
    b, n, half = _sizes(rng, (1, 4), (1, 32), (1, 32))
    return {"model": "positional_encoding", "queries": _floats(rng, b, n, 2 * half)}


def replayed_toy(_rng: np.random.Generator) -> Body:
    from service.http.schemas import toy_request

    return toy_request()


def replayed_w2(_rng: np.random.Generator) -> Body:
    rng = np.random.default_rng(0)
    return {"model": "dot_product", "queries": _floats(rng, 8, 128, 64), "keys": _floats(rng, 8, 128, 64),
            "values": _floats(rng, 8, 128, 64), "valid_lens": rng.integers(1, 129, size=8).tolist()}


def replayed_w3(_rng: np.random.Generator) -> Body:
    x = np.ones((2, 4, 100))
    return {"model": "multi_head", "queries": x.tolist(), "keys": np.ones((2, 6, 100)).tolist(),
            "values": np.ones((2, 6, 100)).tolist(), "valid_lens": [3, 2]}


@dataclass(frozen=True)
class Workload:
    name: str
    text: str
    make: Callable[[np.random.Generator], Body]
    pool: int  # bodies in its pool; 1: replayed

    @property
    def replayed(self) -> bool:
        return self.pool == 1

    def bodies(self, seed: int = SEED, count: int | None = None) -> list[Body]:
        """The pool (or its first `count` bodies)."""
        rng = np.random.default_rng([seed, int.from_bytes(self.name.encode(), "little")])
        return [self.make(rng) for _ in range(self.pool if count is None else min(count, self.pool))]


POOL = 512
WORKLOADS = {w.name: w for w in [
    Workload("W1", "additive, varied around the book's toy request (batch 1-4, n_q 1-4, n_k 2-12, values 1-8)",
             toy_additive, POOL),
    # 2-4 MB a body: 24 of them. Bodies over the service's small-body size take no decode plan anyway.
    Workload("W2", "dot_product, varied around 8 x 128 x 128 x 64 (batch 4-8, n_q and n_k 64-128)",
             large_dot_product, 24),
    Workload("W3", "multi_head, varied around the book's example (batch 1-4, n_q and n_k 1-8)", multi_head, POOL),
    Workload("W4", "dot_product, ragged: batch, n_q, n_k, features and value size each 1-16", ragged_dot_product,
             POOL),
    Workload("W5", "self_attention (batch 1-4, n 1-16)", self_attention, POOL),
    Workload("W6", "masked_softmax (batch 1-8, n_q and n_k 1-16)", masked_softmax, POOL),
    Workload("W7", "positional_encoding (batch 1-4, n 1-32, features 2-64; no valid lengths)",
             positional_encoding, POOL),
    Workload("W1r", "the book's toy additive request (2 x 1 x 20 queries, 2 x 10 keys), replayed", replayed_toy, 1),
    Workload("W2r", "dot_product, 8 x 128 x 128 x 64, random 1-D valid lengths, replayed", replayed_w2, 1),
    Workload("W3r", "multi_head, the book's example (2 x 4 x 100, valid lengths [3, 2]), replayed", replayed_w3, 1),
]}


# Transports: a body on the wire.

def attend_json(body: Body) -> tuple[str, bytes, int]:
    return "/attend", json.dumps(body).encode(), 0


def v2_binary(body: Body) -> tuple[str, bytes, int]:
    """The body as an Open Inference Protocol request with binary tensors (float32, valid lengths int64),
    binary outputs asked for (`outputs` alone where it says `return_weights: false`): (path, bytes, the
    JSON header's length)."""
    entries, blobs = [], []
    for name in ("queries", "keys", "values", "scores", "valid_lens"):
        if name not in body:
            continue
        array = np.array(body[name], dtype=np.int64 if name == "valid_lens" else np.float32)
        entries.append({"name": name, "datatype": "INT64" if name == "valid_lens" else "FP32",
                        "shape": list(array.shape), "parameters": {"binary_data_size": array.nbytes}})
        blobs.append(array.tobytes())
    asked = {"outputs": [{"name": "outputs", "parameters": {"binary_data": True}}]} \
        if body.get("return_weights") is False else {"parameters": {"binary_data_output": True}}
    head = json.dumps({"inputs": entries} | asked).encode()
    return f"/v2/models/{body['model']}/infer", head + b"".join(blobs), len(head)


def grpc_raw(body: Body) -> tuple[str, bytes, int]:
    """The body as a serialized `ModelInferRequest` (tritonclient.grpc's protobuf message): float32 tensors
    and int64 valid lengths as `raw_input_contents`, every output asked for (as /attend answers outputs and
    weights by default; `outputs` alone where it says `return_weights: false`): (model, bytes, 0)."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=body["model"])
    for name in ("queries", "keys", "values", "scores", "valid_lens"):
        if name not in body:
            continue
        array = np.array(body[name], dtype=np.int64 if name == "valid_lens" else np.float32)
        request.inputs.add(name=name, datatype="INT64" if name == "valid_lens" else "FP32", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    if body.get("return_weights") is False:
        request.outputs.add(name="outputs")
    return body["model"], request.SerializeToString(), 0


@dataclass(frozen=True)
class Transport:
    name: str
    text: str
    encode: Callable[[Body], tuple[str, bytes, int]]
    client: str  # the load generator that sends it (bench/loadgen.py's CLIENTS)
    plain: bool  # whether bench/plain_server.py speaks it
    http: bool = True  # its pool holds whole HTTP/1.1 requests (else the encoded bytes alone)


TRANSPORTS = {t.name: t for t in [
    Transport("json", "POST /attend, JSON", attend_json, "wrk", True),
    Transport("v2-binary", "POST /v2/models/NAME/infer, binary tensors (Open Inference Protocol)", v2_binary,
              "wrk", False),
    Transport("grpc", "gRPC ModelInfer, raw_input_contents (Open Inference Protocol)", grpc_raw, "grpc", False,
              http=False),
]}

# The rows of the benchmark: name -> (workload, transport).
ROWS = {name: (name, "json") for name in WORKLOADS} | {"W2bin": ("W2", "v2-binary"), "W1grpc": ("W1", "grpc"),
                                                       "W2grpc": ("W2", "grpc")}
DEFAULT_ROWS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W2bin", "W1grpc", "W2grpc", "W1r", "W2r", "W3r")
# Front doors compared within the service, in the same run: row -> the row it is weighed against (the
# issue's bar: W2 through gRPC at least as fast as through HTTP binary; W1 through gRPC at least as fast as
# POST /attend JSON).
FRONT_DOORS = {"W1grpc": "W1", "W2grpc": "W2bin"}


def http_request(path: str, content: bytes, header_length: int) -> bytes:
    """The whole HTTP/1.1 request (keep-alive), as wrk.format would make it."""
    headers = ["Content-Type: application/json"] if not header_length else [
        "Content-Type: application/octet-stream", f"Inference-Header-Content-Length: {header_length}"]
    head = "\r\n".join([f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *headers, f"Content-Length: {len(content)}"])
    return head.encode() + b"\r\n\r\n" + content


def write_pool(folder: Path, name: str, encoded: list[tuple[str, bytes, int]], http: bool = True) -> Path:
    """The pool files bench/pool.lua (and bench/grpc_load.py) read: NAME.pool (whole HTTP requests end to
    end, or with `http` false the encoded messages alone) and NAME.index (the pool file's name, then
    "offset length" a request). Returns the index."""
    data, index = folder / f"{name}.pool", folder / f"{name}.index"
    lines, offset = [str(data)], 0
    with data.open("wb") as out:
        for path, content, header_length in encoded:
            raw = http_request(path, content, header_length) if http else content
            out.write(raw)
            lines.append(f"{offset} {len(raw)}")
            offset += len(raw)
    index.write_text("\n".join(lines) + "\n")
    return index


def make_pools(folder: Path, rows: list[str], seed: int = SEED) -> dict[str, dict]:
    """Each row's pool in `folder`, made once for the run and shared by every server: row -> {"index":
    Path, "bodies": count, "median_bytes": ...}."""
    made: dict[str, list[Body]] = {}
    pools = {}
    for row in rows:
        workload, transport = ROWS[row]
        if workload not in made:
            made[workload] = WORKLOADS[workload].bodies(seed)
        encoded = [TRANSPORTS[transport].encode(body) for body in made[workload]]
        pools[row] = {"index": write_pool(folder, row, encoded, TRANSPORTS[transport].http), "bodies": len(encoded),
                      "median_bytes": int(np.median([len(e[1]) for e in encoded]))}
    return pools
