"""docs/examples, each run as a user runs it (a subprocess, ATTEND_URL naming the service) against the real
service process, and what it prints compared with the book's answer to the toy dot-product request
(docs/attend.md): the values, not only the exit status. Every file of docs/examples is run here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.server import ROOT, free_port, running_service

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "docs" / "examples"
KEY = "example-key"
# The book's toy request: row 0 attends to its first 2 keys, row 1 to all 3 (docs/attend.md's and README's answer).
OUTPUTS = [[[1.0, 2.0]], [[2.0, 3.0]]]
WEIGHTS = [[[0.5, 0.5, 0.0]], [[1 / 3, 1 / 3, 1 / 3]]]


@pytest.fixture(scope="module")
def service(repository):
    """The service, once for the module, with an API key (the examples send ATTEND_API_KEY) and gRPC:
    (its URL, its gRPC address)."""
    port = free_port()
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1", ATTEND_API_KEYS=KEY,
                         ATTEND_GRPC_PORT=str(port)) as (url, _):
        yield url, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def url(service):
    return service[0]


def run(args: list[str], url: str, key: str | None = KEY, **more: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATTEND_API_KEY"} | {"ATTEND_URL": url} | more
    if key is not None:
        env["ATTEND_API_KEY"] = key
    command = ["bash"] if args[0].endswith(".sh") else [sys.executable]
    return subprocess.run([*command, str(EXAMPLES / args[0]), *args[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def printed(stdout: str) -> dict[str, str]:
    """The `name: value` lines an example prints."""
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


def assert_book_answer(outputs, weights) -> None:
    np.testing.assert_allclose(outputs, OUTPUTS, rtol=1e-6)
    np.testing.assert_allclose(weights, WEIGHTS, rtol=1e-6)
    assert np.shape(outputs) == (2, 1, 2) and np.shape(weights) == (2, 1, 3)
    assert np.asarray(weights)[0, 0, 2] == 0.0  # the masked key: exactly 0


def test_every_example_is_run_here():
    tested = {"attend_httpx.py", "attend_requests.py", "v2_tritonclient.py", "v2_curl.sh", "v2_grpc.py"}
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == tested


@pytest.mark.parametrize("example", ["attend_httpx.py", "attend_requests.py"])
def test_attend_example_prints_the_book_answer(url, example):
    result = run([example], url)
    assert result.returncode == 0, result.stderr
    lines = printed(result.stdout)
    assert_book_answer(json.loads(lines["outputs"]), json.loads(lines["attention_weights"]))
    assert lines["model"].split() == ["dot_product", "version:", "1"] + (["header:", "1"] if "requests" in example
                                                                         else [])
    assert lines["request id"] not in ("", "None")


def test_requests_example_prints_the_service_error_body(url):
    result = run(["attend_requests.py", "additive"], url)  # the toy's 2 features, additive's queries take 20
    assert result.returncode == 1, result.stdout + result.stderr
    lines = printed(result.stdout)
    assert lines["refused"].startswith("HTTP 422, request id ")
    error = json.loads(lines["error"])
    assert error["code"] == "invalid_shape" and error["field"] == "queries"
    assert error["expected"] == ["batch", "n_q", 20] and error["received"] == [2, 1, 2]

    result = run(["attend_requests.py"], url, key=None)
    assert result.returncode == 1 and json.loads(printed(result.stdout)["error"])["code"] == "unauthorized"


def test_requests_example_says_when_nothing_answers():
    result = run(["attend_requests.py"], f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2 and "cannot reach" in result.stderr


def test_tritonclient_example_prints_the_book_answer(url):
    result = run(["v2_tritonclient.py"], url)
    assert result.returncode == 0, result.stderr
    lines = printed(result.stdout)
    assert lines["ready"] == "True"
    assert lines["model"].split() == ["dot_product", "version:", "1", "id:", "toy-1"]
    assert_book_answer(json.loads(lines["outputs"]), json.loads(lines["attention_weights"]))


def test_grpc_example_prints_the_book_answer(service):
    """The address as every example takes it: ATTEND_URL's host, and the service's ATTEND_GRPC_PORT."""
    url, address = service
    port = address.rsplit(":", 1)[1]
    result = run(["v2_grpc.py"], url, ATTEND_GRPC_PORT=port)
    assert result.returncode == 0, result.stderr
    lines = printed(result.stdout)
    assert lines["ready"] == "True"
    assert lines["model"].split() == ["dot_product", "version:", "1", "id:", "toy-1"]
    assert_book_answer(json.loads(lines["outputs"]), json.loads(lines["attention_weights"]))

    refused = run(["v2_grpc.py"], url, key=None, ATTEND_GRPC_PORT=port)  # no key: UNAUTHENTICATED
    assert refused.returncode == 1 and "StatusCode.UNAUTHENTICATED" in refused.stderr
    # ATTEND_URL's host is the one asked: a host with no service there, and the call fails naming it.
    elsewhere = run(["v2_grpc.py"], "http://127.0.0.2:1", ATTEND_GRPC_PORT=str(free_port()))
    assert elsewhere.returncode == 1 and "127.0.0.2" in elsewhere.stderr
    # An argument overrides both.
    assert run(["v2_grpc.py", address], "http://127.0.0.2:1").returncode == 0


def test_curl_example_prints_the_metadata_and_the_book_answer(url):
    result = run(["v2_curl.sh"], url)
    assert result.returncode == 0, result.stderr
    metadata, answer = (json.loads(line) for line in result.stdout.splitlines() if line.strip())
    assert metadata["name"] == "dot_product"
    assert [(i["name"], i["datatype"]) for i in metadata["inputs"]] == [
        ("queries", "FP32"), ("keys", "FP32"), ("values", "FP32"), ("valid_lens", "INT64")]
    assert answer["model_name"] == "dot_product" and answer["model_version"] == "1" and answer["id"] == "toy-1"
    tensors = {t["name"]: t for t in answer["outputs"]}
    assert tensors["outputs"]["shape"] == [2, 1, 2] and tensors["attention_weights"]["shape"] == [2, 1, 3]
    assert_book_answer(np.reshape(tensors["outputs"]["data"], (2, 1, 2)),
                       np.reshape(tensors["attention_weights"]["data"], (2, 1, 3)))

    refused = run(["v2_curl.sh"], url, key=None)  # the protocol's own error body, curl's exit status 22
    assert refused.returncode == 22 and "error" in json.loads(refused.stdout.splitlines()[0])
