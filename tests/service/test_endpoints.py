"""Models, health, metrics, OpenAPI; readiness; torch stays out of the service."""

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from service.config import Settings, usable_cores
from service.core.runtime import Registry, StartupError
from service.http.app import create_app
from service.http.schemas import toy_request


@pytest.fixture
def client(served):
    """Every test of this module against each server (tests/service/conftest.py's SERVERS)."""
    return served


def test_models_lists_every_model_with_its_provider(client):
    body = client.get("/models").json()
    names = [m["name"] for m in body["models"]]
    assert names == ["additive", "dot_product", "masked_softmax", "multi_head", "positional_encoding",
                     "self_attention"]
    assert {m["provider"] for m in body["models"]} == {"CPUExecutionProvider"}


def test_one_model(client):
    body = client.get("/models/additive").json()
    assert body["kind"] == "additive" and body["version"] == 1
    assert body["hyperparameters"] == {"key_size": 2, "query_size": 20, "num_hiddens": 8}
    assert body["feature_sizes"] == {"queries": 20, "keys": 2, "values": "any"}
    assert body["dynamic_axes"]["values"] == {"0": "batch", "1": "n_k", "2": "value_size"}
    assert client.get("/models/dot_product").json()["feature_sizes"]["constraint"].startswith("queries and keys")
    assert client.get("/models/self_attention").json()["max_len"] == 1000


def test_unknown_model_is_404(client):
    response = client.get("/models/nope")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["field"] == "name"


def test_health(client):
    assert client.get("/health/live").json() == {"status": "alive"}
    ready = client.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_not_ready_before_the_models_are_loaded(settings):
    client = TestClient(create_app(settings))  # no `with`: the lifespan has not run
    assert client.get("/health/live").status_code == 200
    response = client.get("/health/ready")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "not_ready"
    assert client.post("/attend", json=toy_request()).status_code == 503


def test_metrics_count_requests_by_model_and_status(client):
    def count(model, status):
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(f'attend_requests_total{{model="{model}",protocol="http",status="{status}"}}'):
                return float(line.split()[-1])
        return 0.0

    ok, bad = count("additive", "200"), count("additive", "422")
    assert client.post("/attend", json=toy_request()).status_code == 200
    assert client.post("/attend", json=toy_request() | {"keys": [[[1.0]]]}).status_code == 422
    assert count("additive", "200") == ok + 1
    assert count("additive", "422") == bad + 1
    text = client.get("/metrics").text
    assert 'attend_request_duration_seconds_bucket{le="0.005",model="additive",protocol="http"}' in text
    assert 'attend_inference_seconds_count{model="additive"}' in text
    assert "attend_ready 1.0" in text


def test_openapi_documents_the_toy_example(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/attend"]["post"]["requestBody"]["content"]["application/json"]
    assert body["example"]["model"] == "additive" and body["example"]["valid_lens"] == [2, 6]
    assert set(body["schema"]["properties"]) == {"model", "version", "queries", "keys", "values", "scores",
                                                 "valid_lens", "return_weights"}
    ok = spec["paths"]["/attend"]["post"]["responses"]["200"]
    assert "X-Model-Version" in ok["headers"]
    assert "model_version" in spec["components"]["schemas"]["AttendResponse"]["required"]
    assert client.get("/docs").status_code == 200


def test_cuda_without_a_gpu_refuses_to_start(settings):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            Registry.load(settings.model_repository, "cuda", 1, warmup=False)
            pytest.skip("this machine has a working CUDA execution provider")
        except StartupError as e:
            assert "ATTEND_DEVICE=cuda but CUDA cannot be used (" in str(e) and "CUDA 13 and cuDNN 9" in str(e)
    else:
        with pytest.raises(StartupError):
            Registry.load(settings.model_repository, "cuda", 1, warmup=False)


def test_missing_repository_is_a_startup_error(tmp_path):
    with pytest.raises(StartupError, match="does not exist"):
        Registry.load(tmp_path / "nowhere", "cpu", 1)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(StartupError, match="is a file, not a folder"):  # before: "does not exist"
        Registry.load(tmp_path / "a_file", "cpu", 1)


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTEND_PORT", "9123")
    monkeypatch.setenv("ATTEND_DEVICE", "cpu")
    monkeypatch.setenv("ATTEND_WORKERS", "2")
    monkeypatch.setenv("ATTEND_MODEL_REPOSITORY", str(tmp_path))
    s = Settings()
    assert (s.port, s.device, s.workers, s.model_repository) == (9123, "cpu", 2, tmp_path)
    assert s.resolved_intra_op_threads() >= 1


def test_intra_op_threads_past_the_cores_are_the_cores_and_said_so(tmp_path):
    """Before, ATTEND_INTRA_OP_THREADS=100000 made every session's pool that big: the start did not end in
    25 s, and SIGTERM meanwhile went unanswered (the loads were in ONNX Runtime's code)."""
    usable = usable_cores()  # taskset's cores, and a CPU quota's
    assert Settings(intra_op_threads=10**5).resolved_intra_op_threads() == usable
    assert Settings(intra_op_threads=1).resolved_intra_op_threads() == 1
    env = {"PATH": os.environ["PATH"], "ATTEND_INTRA_OP_THREADS": "100000",
           "ATTEND_MODEL_REPOSITORY": str(tmp_path / "nowhere")}  # then it stops: the warning comes before
    result = subprocess.run([sys.executable, "-m", "service"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert (f"WARNING service [-] ATTEND_INTRA_OP_THREADS=100000 is more than the cores this process may use "
            f"({usable}): {usable} threads a run") in result.stderr, result.stderr


@pytest.mark.parametrize("workers, said", [("2", True), ("1", False)])
def test_workers_past_the_cores_are_said(tmp_path, workers, said):
    """Before, nothing said it: compose's GPU default of 8 workers on a host of fewer cores."""
    env = {"PATH": os.environ["PATH"], "ATTEND_WORKERS": workers, "ATTEND_MODEL_REPOSITORY": str(tmp_path / "nowhere")}
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "service"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1  # no repository: the warning comes before
    line = ("WARNING service [-] ATTEND_WORKERS=2 is more than the cores this process may use (1): the workers take "
            "turns on them, each holding every model")
    assert (line in result.stderr) == said, result.stderr


def test_the_service_does_not_import_torch():
    code = ("import sys, service.http.app, service.grpc.server, service.asgi, service.__main__; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_work_without_internet(client, page):
    """Every script, stylesheet and image of the docs pages comes from the service itself."""
    import re

    html = client.get(page).text
    assert "openapi.json" in html
    urls = re.findall(r'(?:src|href)=["\']([^"\']+)["\']|url: *["\']([^"\']+)["\']', html)
    urls = [u for pair in urls for u in pair if u]
    assert urls, html
    for url in urls:
        assert not re.match(r"^(https?:)?//", url), f"{page} loads {url} from another host"
        assert client.get(url).status_code == 200, url
    assert not re.findall(r"https?://", html)  # no other host named anywhere in the page
