"""Large JSON bodies parsed in a decode process (service.protocols.json_process) give the arrays and errors a
decode thread gives; the event loop's thread waits for the GIL a fraction as long; a process that dies or runs
past a deadline is replaced and the service goes on; the server starts one a worker and none outlives it."""

import contextlib
import json
import os
import signal
import time
import types
import zlib
from functools import partial

import httpx
import numpy as np
import psutil
import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.core.cost import PRECISE_BODY_BYTES, Budget, Cost
from service.core.errors import DeadlineExceeded, ServiceError
from service.core.runtime import Registry
from service.http.app import create_app
from service.protocols.attend import AttendCodec, attend
from service.protocols.json_process import JsonProcesses, NotStarted, read_fields
from service.protocols.v2 import InferCodec
from tests.load.bodies import json_dense, v2_json_dense
from tests.load.gil import longest_wait
from tests.server import running_service
from tests.service.test_bad_input import CASES
from tests.service.test_decode import _random_body
from tests.service.test_v2 import BAD

LIMITS = Settings().request_limits()
_QUERIES = partial(read_fields, fields={"model", "queries"}, arrays_in={"queries": "<f4"})


@pytest.fixture(scope="module")
def registry(repository):
    return Registry.load(repository, "cpu", 1)


@pytest.fixture(scope="module")
def processes():
    processes = JsonProcesses(1)
    yield processes
    processes.close()


def dead(process: psutil.Process) -> None:
    """Once `process` is dead: not reaped (its exit code kept for its parent), or gone (a server's worker may
    have reaped it already)."""
    try:
        while process.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass


@contextlib.contextmanager
def answered_by(processes, fallback: bool = False):
    """Asserts that `processes` (where given) answered: none failed and was replaced."""
    replaced = processes.replaced if processes is not None else 0
    yield
    assert fallback or processes is None or processes.replaced == replaced, "a decode process failed"


def large(body: bytes) -> bytes:
    """The body past 1 MiB (where the process takes it): blanks after it, as JSON allows."""
    return body + b" " * max(0, PRECISE_BODY_BYTES + 1 - len(body))


def decoded(body: bytes, registry, processes=None, fallback: bool = False):
    """What the /attend codec makes of `body`: the feed, or the error (its body and its model label).
    Unless `fallback`, a process that failed (its body parsed on the thread) is an error of the test's."""
    core = types.SimpleNamespace(registry=registry, limits=LIMITS, json_processes=processes)
    with answered_by(processes, fallback):
        try:
            request, _ = AttendCodec().decode(core, (None, None), {}, body, Cost(Budget(1 << 40)))
        except ServiceError as e:
            return type(e).__name__, e.status, e.body(), e.model
    return {k: (v.dtype, v.shape, v.tobytes()) for k, v in request.feed.items()} | {
        "return_weights": request.return_weights, "model": request.model.name}


@pytest.mark.parametrize("kind", ["dot_product", "additive", "multi_head", "self_attention", "masked_softmax"])
def test_a_process_gives_the_arrays_a_thread_gives(registry, processes, kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    for style in ("compact", "indented", "integers", "exponents"):
        if kind == "masked_softmax":
            scores = rng.normal(size=(3, 4, 5)).tolist()
            body = json.dumps({"model": kind, "scores": scores, "valid_lens": [[1, 2, 3, 5]] * 3}).encode()
        else:
            body = _random_body(rng, kind, style)
        body = large(body)
        thread, process = decoded(body, registry), decoded(body, registry, processes)
        assert isinstance(thread, dict), thread
        assert process == thread, body[:200]


def test_a_large_body_of_numbers_is_the_same_read_in_a_process(registry, processes):
    body = json_dense(4 << 20).content
    thread, process = decoded(body, registry), decoded(body, registry, processes)
    assert isinstance(thread, dict) and thread["queries"][1][0] > 1, thread.keys()
    assert process == thread


@pytest.mark.parametrize("case", [c for c in CASES if isinstance(c[1], dict | bytes)], ids=lambda c: c[0])
def test_a_process_gives_the_error_a_thread_gives(registry, processes, case):
    body = large(case[1] if isinstance(case[1], bytes) else json.dumps(case[1]).encode())
    thread = decoded(body, registry)
    assert decoded(body, registry, processes) == thread


@pytest.mark.parametrize("body", [
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [[2]]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, "4"]]], "values": [[[1], [2]]]}',
    b'{"model": ["dot_product"], "queries": [[[1, 2]]]}',
    b'{"model": {"name": "dot_product"}, "queries": [[[1, 2]]]}',
    b'{"model": "dot_product", "queries": [[[1e39, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]]}',
    b'{"model": "dot_product", "queries": {"a": 1}, "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]], '
    b'"valid_lens": [16777217]}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]], '
    b'"return_weights": [true]}',
    b'{"model": "dot_product", "model": "additive"}',
    b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], "values": [[[1], [2]]]',
])
def test_what_only_the_service_checks_is_checked_after_a_process(registry, processes, body):
    """The process reads no model: arrays in the wrong field, float32's overflow, a number past float32's
    integers in valid_lens, a value of the wrong type are the service's to refuse, as from a thread."""
    body = large(body)
    thread = decoded(body, registry)
    assert isinstance(thread, tuple), thread
    assert decoded(body, registry, processes) == thread


def test_the_event_loop_waits_a_fraction_as_long(registry, processes):
    body = json_dense(8 << 20).content
    core = types.SimpleNamespace(registry=registry, limits=LIMITS, json_processes=processes)
    thread = min(longest_wait(lambda: decoded(body, registry))[0] for _ in range(2))
    process = min(longest_wait(lambda: AttendCodec().decode(core, (None, None), {}, body, Cost(Budget(1 << 40))))[0]
                  for _ in range(2))
    assert process < thread / 3, (process, thread)


def test_the_process_and_the_body_copy_it_reads_are_counted(registry, processes):
    body = json_dense(4 << 20).content
    costs = []
    for core_processes in (None, processes):
        cost = Cost(Budget(1 << 40))
        core = types.SimpleNamespace(registry=registry, limits=LIMITS, json_processes=core_processes)
        AttendCodec().decode(core, (None, None), {}, body, cost)
        costs.append(cost.peak)
    assert costs[1] == costs[0] + len(body)


def test_a_process_that_dies_is_replaced_and_its_body_decoded_all_the_same(registry, caplog):
    processes = JsonProcesses(1)
    try:
        body = large(json.dumps({"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]],
                                 "values": [[[1], [2]]]}).encode())
        expected = decoded(body, registry)
        first = processes.pids()[0]
        os.kill(first, signal.SIGKILL)
        dead(psutil.Process(first))
        assert decoded(body, registry, processes, fallback=True) == expected  # parsed on the thread
        assert processes.replaced == 1 and processes.pids()[0] != first
        assert "a JSON decode process failed" in caplog.text and "exit -9)" in caplog.text
        assert decoded(body, registry, processes) == expected and processes.replaced == 1  # by the new one
    finally:
        processes.close()
    assert not psutil.pid_exists(processes.pids()[0]) or psutil.Process(processes.pids()[0]).status() == "zombie"


def test_a_reader_that_fails_leaves_its_process_serving(caplog):
    """A reader's own fault (not a ServiceError) is one body's: the thread decodes it, no process is started."""
    processes = JsonProcesses(1)
    try:
        first, body = processes.pids()[0], large(b'{"model": "dot_product", "queries": [[[1, 2]]]}')
        assert processes.parse(body, partial(read_fields, fields=None, arrays_in={}), None) is None
        assert "a JSON decode process's reader raised TypeError; the body is decoded on the thread" in caplog.text
        data = processes.parse(body, _QUERIES, None)
        assert data["queries"].array.tolist() == [[[1.0, 2.0]]]
        assert processes.replaced == 0 and processes.pids() == [first] and psutil.Process(first).is_running()
    finally:
        processes.close()


def test_a_process_past_the_deadline_is_replaced(registry):
    processes = JsonProcesses(1)
    try:
        body = json_dense(16 << 20).content
        first = processes.pids()[0]
        with pytest.raises(DeadlineExceeded):
            processes.parse(body, partial(read_fields, fields={"model", "queries", "keys", "values"},
                                          arrays_in={"queries": "<f4"}), time.monotonic() + 0.005)
        assert processes.replaced == 1 and processes.pids()[0] != first and not psutil.pid_exists(first)
        small = large(b'{"model": "dot_product", "queries": [[[1, 2]]]}')
        data = processes.parse(small, _QUERIES, None)
        assert data["model"] == "dot_product" and data["queries"].array.tolist() == [[[1.0, 2.0]]]
    finally:
        processes.close()


def _decode_processes(pid: int) -> list[psutil.Process]:
    """The live decode processes of the service `pid` and its workers."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            if "service.protocols.json_process" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.ZombieProcess:  # dead, not yet reaped
            pass
    return found


@pytest.mark.parametrize("workers", [1, 2])
def test_the_server_decodes_in_a_process_a_worker_and_leaves_none_behind(repository, registry, workers, tmp_path):
    body = large(json.dumps({"model": "dot_product", "queries": np.ones((2, 3, 4)).tolist(),
                             "keys": np.ones((2, 5, 4)).tolist(), "values": np.ones((2, 5, 2)).tolist(),
                             "valid_lens": [2, 5]}).encode())
    expected = json.loads(attend(body, registry, LIMITS))
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_WORKERS=str(workers), ATTEND_JSON_PROCESSES="1",
                         ATTEND_LOG_LEVEL="info") as (url, proc):
        deadline = time.monotonic() + 60  # ready: one worker is; the others' come as they open
        while len(children := _decode_processes(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(children) == workers, children
        answer = httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert answer.status_code == 200 and answer.json() == expected
        infer = large(json.dumps({"inputs": [
            {"name": name, "datatype": "FP32", "shape": [2, n, d], "data": np.ones(2 * n * d).tolist()}
            for name, n, d in (("queries", 3, 4), ("keys", 5, 4), ("values", 5, 2))] + [
            {"name": "valid_lens", "datatype": "INT64", "shape": [2], "data": [2, 5]}]}).encode())
        answer = httpx.post(f"{url}/v2/models/dot_product/infer", content=infer, timeout=60)
        assert answer.status_code == 200, answer.text
        assert {o["name"]: o["data"] for o in answer.json()["outputs"]} == {
            "outputs": np.ravel(expected["outputs"]).tolist(),
            "attention_weights": np.ravel(expected["attention_weights"]).tolist()}
        beyond = large(json.dumps({"inputs": [{"name": "queries", "datatype": "FP32", "shape": [1], "data": [1e39]}]
                                   }).encode())  # cast to inf in the process, refused in the worker: no warning
        answer = httpx.post(f"{url}/v2/models/dot_product/infer", content=beyond, timeout=60)
        assert answer.status_code == 400 and "needs input(s) keys" in answer.json()["error"], answer.text
        children[0].kill()
        dead(children[0])
        for _ in range(2 * workers):  # each worker: the one whose process died decodes it on its thread
            answer = httpx.post(f"{url}/attend", content=body, timeout=60)
            assert answer.status_code == 200 and answer.json() == expected
        if workers == 1:
            assert [p.pid for p in _decode_processes(proc.pid)] != [children[0].pid]
        children = _decode_processes(proc.pid)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children), children
    assert "Warning" not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()[-2000:]


@pytest.mark.parametrize(("cores", "workers", "count"), [(1, 1, 0), (2, 1, 1), (2, 2, 0), (4, 2, 1), (64, 1, 1)])
def test_auto_is_one_where_a_worker_has_a_core_to_spare(monkeypatch, cores, workers, count):
    monkeypatch.setattr("service.config.usable_cores", lambda: cores)
    assert Settings(workers=workers).resolved_json_processes() == count
    assert Settings(workers=workers, json_processes=3).resolved_json_processes() == 3


@pytest.mark.parametrize(("pin", "setting", "count"), [("0", "0", 0), ("0", "auto", 0), ("0,1", "auto", 1)])
def test_none_where_the_setting_says_none(repository, pin, setting, count):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to let the service use both")
    with running_service(repository, prefix=("taskset", "-c", pin), ATTEND_JSON_PROCESSES=setting) as (url, proc):
        assert len(_decode_processes(proc.pid)) == count
        body = large(json.dumps({"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]],
                                 "values": [[[1], [2]]]}).encode())
        assert httpx.post(f"{url}/attend", content=body, timeout=60).status_code == 200


def test_a_decode_under_way_as_the_server_stops_starts_no_process():
    processes = JsonProcesses(1)
    first = processes.pids()[0]
    processes.close()
    body = large(b'{"model": "dot_product", "queries": [[[1, 2]]]}')
    assert processes.parse(body, _QUERIES, None) is None  # on the thread, then
    assert processes.pids() == [first] and processes.replaced == 0 and not psutil.pid_exists(first)


def test_a_process_that_cannot_start_says_so_at_the_start(monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")
    with pytest.raises(NotStarted, match=r"^a JSON decode process did not start \(exit 1; its error is above\): "
                                         r"large JSON bodies are parsed on the decode threads$"):
        JsonProcesses(1)


def test_a_service_whose_process_cannot_start_serves_without(repository, registry, monkeypatch, caplog):
    monkeypatch.setattr("sys.executable", "/bin/false")
    app = create_app(Settings(model_repository=repository, device="cpu", json_processes=1))
    with TestClient(app) as client:
        assert app.state.dataplane.json_processes is None
        assert "a JSON decode process did not start (exit 1" in caplog.text
        body = large(b'{"model": "dot_product", "queries": [[[1, 2]]], "keys": [[[1, 2], [3, 4]]], '
                     b'"values": [[[1], [2]]]}')
        answer = client.post("/attend", content=body)
        assert answer.status_code == 200 and answer.json() == json.loads(attend(body, registry, LIMITS))


# ----------------------------------------------------- the Open Inference Protocol's JSON (service.protocols.v2)


def inferred(body: bytes, headers: dict, registry, processes=None, model: str = "additive"):
    """What the inference codec makes of `body` for `model`: the feed and the answer to it, or the error."""
    core = types.SimpleNamespace(registry=registry, limits=LIMITS, json_processes=processes, regions=None,
                                 inline_decode_bytes=0, loop_thread=None)
    headers = {k.lower().encode(): str(v).encode() for k, v in headers.items()}
    with answered_by(processes):
        try:
            request, encode = InferCodec().decode(core, (model, None), headers, body, Cost(Budget(1 << 40)))
        except ServiceError as e:
            return type(e).__name__, e.status, e.body(), e.model
    answer = encode(request.model, request.model.run(request.feed, request.return_weights), request.return_weights)
    parts = answer.body if isinstance(answer.body, list) else [answer.body]
    return {k: (v.dtype, v.shape, v.tobytes()) for k, v in request.feed.items()} | {
        "return_weights": request.return_weights, "timeout": request.timeout_s, "held": request.held,
        "text": request.text_answer, "answer": b"".join(map(bytes, parts)), "headers": answer.headers}


def padded(body: bytes, headers: dict) -> tuple[bytes, dict]:
    """The body's JSON head past 1 MiB (blanks after it; the binary tensors after those), where the header
    says where it ends; else blanks at the end."""
    length = headers.get("Inference-Header-Content-Length")
    pad = b" " * (PRECISE_BODY_BYTES + 1)
    if length is not None and str(length).isdigit() and 0 < int(length) <= len(body):
        return body[:int(length)] + pad + body[int(length):], headers | {
            "Inference-Header-Content-Length": str(int(length) + len(pad))}
    return body + pad, headers


def _input(name: str, data, datatype: str = "FP32", shape=None, **more) -> dict:
    data = np.asarray(data)
    return {"name": name, "datatype": datatype, "shape": list(data.shape) if shape is None else shape,
            "data": data.tolist(), **more}


_RNG = np.random.default_rng(7)
_Q, _K, _V = _RNG.normal(size=(2, 3, 20)), _RNG.normal(size=(2, 5, 2)), _RNG.normal(size=(2, 5, 4))
_GOOD = [_input("queries", _Q), _input("keys", _K), _input("values", _V.ravel(), shape=[2, 5, 4])]
_MANY = {str(i): i for i in range(70)}  # more values than a request's small fields may hold
INFER = [  # (id, body): requests only the service can answer or refuse, and what a decode process reads ahead
    ("good", {"inputs": _GOOD}),
    ("good-id-lens-timeout", {"id": "x" * 100, "parameters": {"timeout": 5_000_000}, "inputs": [
        *_GOOD, _input("valid_lens", [2, 5], "INT64")], "outputs": [{"name": "outputs"}]}),
    ("int32-lens-fp64-binary-out", {"parameters": {"binary_data_output": True}, "inputs": [
        *_GOOD[:2], {**_GOOD[2], "datatype": "FP64"}, _input("valid_lens", [[1, 2, 3], [5, 4, 3]], "INT32")]}),
    ("id-before-parameters", {"id": 7, "parameters": _MANY, "inputs": _GOOD}),
    ("parameters-before-inputs", {"parameters": _MANY, "inputs": 5}),
    ("inputs-an-object", {"inputs": {"queries": 1}}),
    ("an-input-named-wrong-before-one-too-large", {"inputs": [{**_GOOD[0], "name": "q"}, _MANY]}),
    ("an-input-too-large", {"inputs": [_GOOD[0], {**_GOOD[1], **_MANY}]}),
    ("an-input-not-an-object", {"inputs": [_GOOD[0], [1, 2]]}),
    ("a-shape-too-large", {"inputs": [{**_GOOD[0], "shape": list(range(70))}]}),
    ("data-an-object", {"inputs": [_GOOD[0], {**_GOOD[1], "data": {"a": 1}}]}),
    ("data-a-string", {"inputs": [{**_GOOD[0], "data": "1, 2"}]}),
    ("data-not-numbers", {"inputs": [_GOOD[0], {**_GOOD[1], "data": [[1, 2], [3, "4"]]}]}),
    ("data-past-float32", {"inputs": [_input("queries", _Q * 1e39), *_GOOD[1:]]}),
    ("good-fp16-data-past-float16s-range", {"inputs": [_input("queries", _Q * 1e5, "FP16"), *_GOOD[1:]]}),
    ("good-int-data", {"inputs": [_input("queries", np.arange(40).reshape(2, 1, 20)), *_GOOD[1:]]}),
    ("datatype-a-list", {"inputs": [{**_GOOD[0], "datatype": ["INT64"]}, *_GOOD[1:]]}),
    ("datatype-an-object", {"inputs": [{**_GOOD[0], "datatype": {"INT64": 1}}, *_GOOD[1:]]}),
    ("lens-not-integers", {"inputs": [*_GOOD, _input("valid_lens", [2.5, 3], "INT64")]}),
    ("lens-past-the-keys", {"inputs": [*_GOOD, _input("valid_lens", [2, 9], "INT64")]}),
    ("data-with-a-binary-size", {"inputs": [{**_GOOD[0], "data": "never read",
                                             "parameters": {"binary_data_size": 4}}]}),
    ("outputs-too-large", {"inputs": _GOOD, "outputs": [{"name": "outputs"}] * 70}),
    ("outputs-an-object", {"inputs": _GOOD, "outputs": {"name": "outputs"}}),
    ("an-array", [_GOOD]),
    ("a-number", 5),
]


@pytest.mark.parametrize("case", INFER, ids=[c[0] for c in INFER])
def test_a_process_reads_an_inference_request_as_a_thread_does(registry, processes, case):
    body, headers = padded(json.dumps(case[1]).encode(), {})
    thread = inferred(body, headers, registry)
    assert inferred(body, headers, registry, processes) == thread
    assert isinstance(thread, dict) == case[0].startswith(("good", "int32")), thread


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_process_refuses_a_bad_inference_request_as_a_thread_does(registry, processes, case):
    body, headers = case[1]
    body, headers = padded(json.dumps(body).encode() if isinstance(body, dict) else body, headers)
    thread = inferred(body, headers, registry)
    assert isinstance(thread, tuple), thread
    assert inferred(body, headers, registry, processes) == thread


def test_a_large_inference_request_is_the_same_read_in_a_process(registry, processes):
    body = v2_json_dense(4 << 20)
    thread = inferred(body.content, body.headers, registry, model="dot_product")
    assert isinstance(thread, dict) and thread["queries"][1][0] > 1, thread
    assert inferred(body.content, body.headers, registry, processes, model="dot_product") == thread


def test_an_inference_requests_head_keeps_the_event_loop_waiting_a_fraction_as_long(registry, processes):
    body = v2_json_dense(8 << 20)
    headers = {k.encode(): v.encode() for k, v in body.headers.items()}

    def decode(processes):
        core = types.SimpleNamespace(registry=registry, limits=LIMITS, json_processes=processes, regions=None,
                                     inline_decode_bytes=0, loop_thread=None)
        InferCodec().decode(core, ("dot_product", None), headers, body.content, Cost(Budget(1 << 40)))

    thread = min(longest_wait(lambda: decode(None))[0] for _ in range(2))
    with answered_by(processes):
        process = min(longest_wait(lambda: decode(processes))[0] for _ in range(2))
    assert process < thread / 3, (process, thread)
