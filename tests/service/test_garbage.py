"""Requests leave no reference cycles behind: everything a request makes is freed by reference counting
when it ends, so Python's garbage collector has nothing to find. A cycle a request (the scope's
extensions bound to their own request, a timer's closure that re-arms itself) made it collect every ~40
requests, 7-18 us a request of the book's toy request, and its full collections stopped the event loop
for 40-60 ms under load. Counted from outside, by the real process's `python_gc_objects_collected_total`
(docs/observability.md), under concurrent keep-alive clients (so batches gather) sending the request
forms of the HTTP front doors, good and bad. (gRPC is left out: grpcio's own server makes a cycle a call,
in its Cython method-handler lookup.)"""

from __future__ import annotations

import gzip
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest

from service.http.schemas import toy_request
from tests.load.membound import resident_after_idle, secondary_heaps, status_mib
from tests.server import free_port, running_service
from tests.service.test_observability import parse

pytestmark = pytest.mark.slow

CLIENTS = 8
ROUNDS = 50  # each client sends every form this many times


def _forms() -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers): the toy request (its keys cut to vary the layout), the book's multi-head
    example, an Open Inference Protocol JSON request, a gzip'd body, and two refusals (a shape and JSON)."""
    json_type = {"content-type": "application/json"}
    toy = toy_request()
    forms = []
    for n_k in (10, 8, 6):  # its valid lengths are 2 and 6
        body = dict(toy, keys=[row[:n_k] for row in toy["keys"]], values=[row[:n_k] for row in toy["values"]])
        forms.append(("/attend", json.dumps(body).encode(), json_type))
    multi_head = {"model": "multi_head", "queries": [[[1.0] * 100] * 4] * 2, "keys": [[[1.0] * 100] * 6] * 2,
                  "values": [[[1.0] * 100] * 6] * 2, "valid_lens": [3, 2]}
    forms.append(("/attend", json.dumps(multi_head).encode(), json_type))
    forms.append(("/attend", gzip.compress(forms[0][1]), {**json_type, "content-encoding": "gzip"}))
    v2 = {"inputs": [{"name": "queries", "shape": [1, 1, 2], "datatype": "FP32", "data": [1, 0]},
                     {"name": "keys", "shape": [1, 2, 2], "datatype": "FP32", "data": [1, 0, 0, 1]},
                     {"name": "values", "shape": [1, 2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    forms.append(("/v2/models/dot_product/infer", json.dumps(v2).encode(), json_type))
    forms.append(("/attend", b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1]]], "values": [[[1]]]}',
                  json_type))
    forms.append(("/attend", b'{"model": "additive", "queries": [[[1, ', json_type))
    return forms


def _collected(url: str) -> float:
    families = parse(httpx.get(f"{url}/metrics", timeout=10).text)
    return sum(s.value for s in families["python_gc_objects_collected"] if s.name.endswith("_total"))


def test_requests_leave_nothing_for_the_garbage_collector(repository):
    forms = _forms()
    statuses: list[int] = []
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1") as (url, _):
        with httpx.Client(base_url=url, timeout=30) as warm:  # first layouts, plans, caches: not per request
            for path, body, headers in forms * 3:
                warm.post(path, content=body, headers=headers)
        before = _collected(url)

        def client() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                for _ in range(ROUNDS):
                    for path, body, headers in forms:
                        statuses.append(http.post(path, content=body, headers=headers).status_code)

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        collected = _collected(url) - before
    requests = CLIENTS * ROUNDS * len(forms)
    assert Counter(statuses) == {200: 6 * CLIENTS * ROUNDS, 422: CLIENTS * ROUNDS, 400: CLIENTS * ROUNDS}
    # With the cycles: ~19 objects a request (the toy request at concurrency 1), collected in batches of
    # hundreds. Without: what is left is a few the first requests of a kind make.
    assert collected <= 0.05 * requests, f"{collected:.0f} objects in reference cycles after {requests} requests"


def test_bodies_refused_on_a_decode_thread_leave_no_memory_behind(repository):
    """A large body is decoded on a thread. Refused there, its error's traceback held the decode's frames
    (the body, simdjson's document, the arrays), and one of those frames held the thread's future, which
    held the error: a cycle that only a full collection frees, and those are rare. These eight bodies (14
    MiB, two cut in half) left 299 MiB resident for good, whatever the budget; now they leave nothing much."""
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((2, 1024, 256), dtype=np.float32)
    bad_keys = orjson.dumps({"model": "dot_product", "queries": queries, "keys": queries[:, :, :128].copy(),
                             "values": queries}, option=orjson.OPT_SERIALIZE_NUMPY)  # 422: d differs
    not_json = bad_keys[: len(bad_keys) // 2] + b"x"  # 400
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1", ATTEND_GRAPH_TIMING_S="0") as (url, proc):
        idle = status_mib(proc.pid, "VmRSS")
        with httpx.Client(base_url=url, timeout=60) as http:
            statuses = [http.post("/attend", content=body, headers={"content-type": "application/json"}).status_code
                        for body in [bad_keys] * 6 + [not_json] * 2]
        left = resident_after_idle(proc.pid, idle)
    assert statuses == [422] * 6 + [400] * 2
    assert len(bad_keys) > 12 << 20
    assert left < 48, f"{left:.0f} MiB more resident than idle after the refusals"


def test_grpc_calls_refused_leave_no_memory_behind(repository):
    """Two ways large gRPC calls stayed resident. A refused call was ended with grpc's `context.abort`,
    whose AbortError grpc keeps on the call: the error's frames (the message, the request decoded from
    it) stayed in a cycle with it until a full collection. And grpc's threads read the messages of
    concurrent calls, each into a glibc heap of its own, whose free end `malloc_trim` does not give back.
    Eight 14 MiB calls from four clients at once left 261 MiB resident (56-62 with either fix alone). One
    heap was not enough: the log's flusher thread started before the process asked for one, and got a heap
    of its own that grpc's threads then took turns with: 0-32 MiB left (CI at a6e44f5); now under 1."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(0)
    queries = rng.standard_normal((2, 1024, 768), dtype=np.float32)
    port = free_port()

    def refused(_) -> list[str]:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            inputs = []
            for name, array in {"queries": queries, "keys": queries[:, :, :384].copy(), "values": queries}.items():
                inputs.append(grpcclient.InferInput(name, list(array.shape), "FP32").set_data_from_numpy(array))
            codes = []
            for _ in range(2):
                try:
                    client.infer("dot_product", inputs)
                    codes.append("OK")
                except InferenceServerException as e:
                    codes.append(e.status())
            return codes

    with running_service(repository, ATTEND_INTRA_OP_THREADS="1", ATTEND_GRAPH_TIMING_S="0",
                         ATTEND_GRPC_PORT=str(port)) as (url, proc):
        idle = status_mib(proc.pid, "VmRSS")
        with ThreadPoolExecutor(4) as pool:
            codes = [code for codes in pool.map(refused, range(4)) for code in codes]
        left = resident_after_idle(proc.pid, idle)
        heaps = secondary_heaps(proc.pid)
    assert codes == ["StatusCode.INVALID_ARGUMENT"] * 8  # the keys' size is not the queries'
    assert queries.nbytes * 2.5 > 14 << 20  # the message
    assert heaps == [], "glibc heaps besides the main one"
    assert left < 8, f"{left:.0f} MiB more resident than idle after the refused calls"
