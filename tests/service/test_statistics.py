"""Triton's statistics extension on a real server (`python -m service`): GET /v2/models[/{m}[/versions/{v}]]/stats
counts what the requests did (exact counts; durations that add up), per model version, behind the API key,
with /v2's error body; a concurrent burst that batches shows in execution_count and batch_stats."""

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest

from export.cli import main as export
from service.http.schemas import toy_request
from tests.server import running_service

KEY = {"Authorization": "Bearer stats-key"}
STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    """additive (versions 1 and 2 loaded) and dot_product, behind an API key; batches wait up to 20 ms
    for the clients the server says are busy (so that the burst below batches)."""
    path = shutil.copytree(repository, tmp_path_factory.mktemp("stats") / "repo")
    for name in ("masked_softmax", "multi_head", "positional_encoding", "self_attention"):
        shutil.rmtree(path / name)
    with running_service(path, ATTEND_INTRA_OP_THREADS="1", ATTEND_API_KEYS="stats-key", ATTEND_MODEL_CONTROL="true",
                         ATTEND_KEEP_VERSIONS="2", ATTEND_MAX_BATCH_WAIT_US="20000") as (url, _), \
            httpx.Client(base_url=url, timeout=30, headers=KEY) as http:
        assert export(["--repository", str(path), "--kind", "additive", "--seed", "7"]) == 0  # additive/2
        assert http.post("/v2/repository/models/additive/load").status_code == 200
        yield http


def _stats(http: httpx.Client, path: str) -> dict:
    response = http.get(path)
    assert response.status_code == 200, response.text
    return response.json()


def _one(http: httpx.Client, name: str, version: int) -> dict:
    [stat] = _stats(http, f"/v2/models/{name}/versions/{version}/stats")["model_stats"]
    assert (stat["name"], stat["version"]) == (name, str(version))
    return stat


def _v2_body() -> dict:
    toy = toy_request()
    inputs = [{"name": n, "datatype": "FP32", "shape": list(np.shape(toy[n])), "data": toy[n]}
              for n in ("queries", "keys", "values")]
    inputs.append({"name": "valid_lens", "datatype": "INT64", "shape": [2], "data": toy["valid_lens"]})
    return {"inputs": inputs}


def _dot_product() -> dict:
    return {"model": "dot_product", "queries": np.ones((2, 3, 4)).tolist(), "keys": np.ones((2, 10, 4)).tolist(),
            "values": np.arange(80, dtype=np.float32).reshape(2, 10, 4).tolist(), "valid_lens": [2, 6]}


def _delta(before: dict, after: dict, *path: str) -> int:
    for key in path:
        before, after = before[key], after[key]
    return after - before


def test_counts_and_durations_of_successes_and_failures(server):
    before = _one(server, "additive", 1)
    started_ms = time.time_ns() // 1_000_000
    for _ in range(3):  # /attend and the Open Inference Protocol count alike: the same model, the same path
        assert server.post("/attend", json=toy_request() | {"version": 1}).status_code == 200
    for _ in range(2):
        assert server.post("/v2/models/additive/versions/1/infer", json=_v2_body()).status_code == 200
    bad = toy_request() | {"version": 1, "queries": [[[1.0]]]}  # 1 feature where additive takes 20
    assert server.post("/attend", json=bad).status_code == 422
    body = _v2_body()
    body["inputs"][0]["shape"] = [2, 1, 19]
    for _ in range(2):
        assert server.post("/v2/models/additive/versions/1/infer", json=body).status_code == 400
    ended_ms = time.time_ns() // 1_000_000
    after = _one(server, "additive", 1)

    inference = {key: {"count": _delta(before, after, "inference_stats", key, "count"),
                       "ns": _delta(before, after, "inference_stats", key, "ns")} for key in after["inference_stats"]}
    assert {key: d["count"] for key, d in inference.items()} == {
        "success": 5, "fail": 3, "queue": 5, "compute_input": 5, "compute_infer": 5, "compute_output": 5,
        "cache_hit": 0, "cache_miss": 0}
    assert _delta(before, after, "inference_count") == 5 * 2  # 2 rows a request
    assert _delta(before, after, "execution_count") == 5  # one after another: a session run each
    assert started_ms <= after["last_inference"] <= ended_ms
    # Every stage takes time, the queue too: each request goes through it, an event loop turn at least.
    assert all(inference[key]["ns"] > 0 for key in ("success", "fail", "queue", "compute_input", "compute_infer",
                                                     "compute_output")), inference
    # Each request's queue and compute durations lie within its time from arrival to answer.
    assert sum(inference[stage]["ns"] for stage in STAGES) <= inference["success"]["ns"]
    # Nothing but integers, as Triton's JSON has them.
    assert all(isinstance(d["count"], int) and isinstance(d["ns"], int) for d in after["inference_stats"].values())


def test_versions_are_counted_apart(server):
    before = {v: _one(server, "additive", v) for v in (1, 2)}
    for version, times in ((1, 2), (2, 3)):
        for _ in range(times):
            assert server.post("/attend", json=toy_request() | {"version": version}).status_code == 200
    assert server.post("/v2/models/additive/infer", json=_v2_body()).status_code == 200  # the newest: 2
    after = {v: _one(server, "additive", v) for v in (1, 2)}
    assert {v: _delta(before[v], after[v], "inference_stats", "success", "count") for v in (1, 2)} == {1: 2, 2: 4}
    assert {v: _delta(before[v], after[v], "inference_count") for v in (1, 2)} == {1: 4, 2: 8}

    every_version = _stats(server, "/v2/models/additive/stats")["model_stats"]
    assert [(s["name"], s["version"]) for s in every_version] == [("additive", "1"), ("additive", "2")]
    everything = _stats(server, "/v2/models/stats")["model_stats"]
    assert [(s["name"], s["version"]) for s in everything] == [("additive", "1"), ("additive", "2"),
                                                               ("dot_product", "1")]
    # No query parameters (as Triton's): a `name` in the query filters nothing and is no 404.
    queried = _stats(server, "/v2/models/stats?name=nope&version=9")["model_stats"]
    assert [(s["name"], s["version"]) for s in queried] == [(s["name"], s["version"]) for s in everything]


@pytest.mark.parametrize(("path", "message"), [
    ("/v2/models/nope/stats", "unknown model 'nope'; available: additive, dot_product"),
    ("/v2/models/nope/versions/1/stats", "unknown model 'nope'; available: additive, dot_product"),
    ("/v2/models/additive/versions/3/stats", "version '3' of model 'additive' is not loaded; loaded: 1, 2"),
    ("/v2/models/additive/versions/x/stats", "version 'x' of model 'additive' is not loaded; loaded: 1, 2"),
    # A digit to str.isdigit, not to int(): was a 500 (a ValueError in find_model) on every /v2 route with a version.
    ("/v2/models/additive/versions/%C2%B2/stats", "version '²' of model 'additive' is not loaded; loaded: 1, 2"),
])
def test_unknown_model_or_version_is_404_in_the_protocols_body(server, path, message):
    response = server.get(path)
    assert response.status_code == 404
    assert response.json() == {"error": message}


def test_behind_the_api_key_and_listed_in_the_extensions(server):
    for path in ("/v2/models/stats", "/v2/models/additive/stats", "/v2/models/additive/versions/1/stats"):
        response = httpx.get(f"{server.base_url}{path}")
        assert response.status_code == 401, path
        assert "error" in response.json()
    assert "statistics" in server.get("/v2").json()["extensions"]


def test_a_concurrent_burst_batches_and_shows_in_batch_stats(server):
    before = _one(server, "dot_product", 1)
    requests = 24
    body = orjson.dumps(_dot_product())
    start = threading.Barrier(requests)

    def send(_: int) -> int:
        # A connection each, open before the burst: then all send at once, and the server's batches wait
        # for the clients it sees busy.
        with httpx.Client(base_url=str(server.base_url), headers=KEY | {"Content-Type": "application/json"},
                          timeout=30) as client:
            assert client.get("/v2/health/live").status_code == 200
            start.wait()
            return client.post("/attend", content=body).status_code

    with ThreadPoolExecutor(requests) as pool:
        codes = list(pool.map(send, range(requests)))
    assert codes == [200] * requests
    after = _one(server, "dot_product", 1)
    executions = _delta(before, after, "execution_count")
    assert 1 <= executions < requests  # some requests shared a session run
    assert _delta(before, after, "inference_count") == 2 * requests
    for stage in ("success", *STAGES):
        assert _delta(before, after, "inference_stats", stage, "count") == requests, stage
    # batch_stats: a row per batch size (rows of a run), each run counted once.
    sizes = {b["batch_size"]: b for b in after["batch_stats"]}
    old = {b["batch_size"]: b for b in before["batch_stats"]}
    runs = {size: b["compute_infer"]["count"] - old.get(size, {"compute_infer": {"count": 0}})["compute_infer"]["count"]
            for size, b in sizes.items()}
    assert sum(runs.values()) == executions
    assert sum(size * n for size, n in runs.items()) == 2 * requests
    assert max(size for size, n in runs.items() if n) > 2  # a batch of more than one request
    for b in after["batch_stats"]:
        assert b["compute_input"]["count"] == b["compute_infer"]["count"] == b["compute_output"]["count"]
        assert b["compute_infer"]["ns"] > 0
