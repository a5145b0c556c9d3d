"""Start-up failures (stop with one line, or skip behind a setting) and SIGTERM under load."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.core.runtime import Registry, StartupError
from service.http.app import create_app
from tests.server import ROOT, free_port, running_service

pytestmark = pytest.mark.slow


@pytest.fixture
def repo_copy(repository, tmp_path):
    return shutil.copytree(repository, tmp_path / "repo")


def _corrupt_file(repo):
    path = repo / "additive" / "1" / "model.onnx"
    path.write_bytes(b"\x08\x07garbage" * 100)
    config = json.loads((repo / "additive" / "config.json").read_text())
    config["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()  # the hash fits: the file is just bad
    (repo / "additive" / "config.json").write_text(json.dumps(config))


def _wrong_sha(repo):
    path = repo / "additive" / "1" / "model.onnx"
    path.write_bytes(path.read_bytes() + b"\x00")


def _wrong_signature(repo):
    config = json.loads((repo / "additive" / "config.json").read_text())
    config["inputs"][0]["shape"] = ["batch", "n_q", 21]  # the graph says 20
    (repo / "additive" / "config.json").write_text(json.dumps(config))


def _bad_config(repo):
    (repo / "additive" / "config.json").write_text("{not json")


def _missing_file(repo):
    (repo / "additive" / "1" / "model.onnx").unlink()


BREAKAGES = [
    (_corrupt_file, "model additive: ONNX Runtime cannot load"),
    (_wrong_sha, "model additive: sha256 of"),
    (_wrong_signature, "model additive: the graph's inputs/outputs"),
    (_bad_config, "model additive: unreadable config.json"),
    (_missing_file, "model.onnx is missing"),
]


@pytest.mark.parametrize("breakage, reason", BREAKAGES, ids=[b[0].__name__ for b in BREAKAGES])
def test_a_broken_model_stops_the_load_with_the_reason(repo_copy, breakage, reason):
    breakage(repo_copy)
    with pytest.raises(StartupError, match=reason):
        Registry.load(repo_copy, "cpu", 1)


def test_the_process_exits_1_with_one_line(repo_copy):
    _wrong_sha(repo_copy)
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repo_copy), "ATTEND_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if "CRITICAL" in line]
    assert len(lines) == 1 and "cannot start: model additive: sha256 of" in lines[0]
    assert "Traceback" not in result.stderr


# Root reads past a file's mode; without its capabilities it is held to the mode as any user is.
AS_ANY_USER = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []


@pytest.mark.parametrize("unreadable, said", [
    ("additive/1/model.onnx", "model additive: additive/1/model.onnx cannot be read: Permission denied"),
    ("additive/1", "model additive: additive/1/model.onnx cannot be read: Permission denied"),
    ("additive", "model additive: additive/config.json cannot be read: Permission denied"),
    (".", "model repository {repo} cannot be read: Permission denied"),
], ids=["file", "version", "model", "repository"])
def test_a_repository_the_service_may_not_read_is_one_line(repo_copy, unreadable, said):
    """A repository exported by one user and served by another (a container's uid) ended the start in a
    traceback (PermissionError); now one line says which file, and as whom."""
    path = repo_copy / unreadable
    path.chmod(0)
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repo_copy), "ATTEND_DEVICE": "cpu"}
    try:
        result = subprocess.run([*AS_ANY_USER, sys.executable, "-m", "service"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        path.chmod(0o755)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if "CRITICAL" in line]
    assert lines == [lines[0]] and lines[0].endswith(
        f"cannot start: {said.format(repo=repo_copy)} (the service runs as uid {os.getuid()})"), result.stderr
    assert "Traceback" not in result.stderr


def test_a_folder_no_model_could_be_named_is_passed_over_unread(repo_copy):
    """A volume's root holds lost+found (root's, mode 0700): the start stopped in a traceback on it."""
    (repo_copy / "lost+found").mkdir(mode=0)
    try:
        with running_service(repo_copy, prefix=AS_ANY_USER, ATTEND_MODEL_CONTROL="true") as (url, _):
            assert httpx.get(f"{url}/v2/models/dot_product/ready").status_code == 200
            index = httpx.post(f"{url}/v2/repository/index").json()
            assert {row["name"] for row in index} == {d.name for d in repo_copy.iterdir()} - {"lost+found"}, index
    finally:
        (repo_copy / "lost+found").chmod(0o755)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_port_or_a_foreign_host_stops_the_start_before_the_models_load(repository, workers):
    """Before, a taken HTTP port was found once every model had loaded (and "ready" logged): uvicorn's
    traceback-free ERROR line, exit code 3; a host not of this machine was blamed on ATTEND_GRPC_PORT."""
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cpu", "ATTEND_WORKERS": workers,
                        "ATTEND_GRPC_PORT": str(free_port())}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [({"ATTEND_PORT": str(port)},
                  f"cannot serve HTTP on 127.0.0.1:{port} (ATTEND_PORT): Address already in use; "
                  "set ATTEND_PORT to a free port"),
                 ({"ATTEND_HOST": "192.0.2.1", "ATTEND_PORT": "8000"},  # TEST-NET-1: no machine's own address
                  "cannot serve HTTP on 192.0.2.1:8000 "
                  "(ATTEND_HOST): Cannot assign requested address; ATTEND_HOST must be an address of this machine")]
        for extra, line in cases:
            result = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env | extra, capture_output=True,
                                    text=True, timeout=60)
            assert result.returncode == 1, result.stderr
            critical = [text for text in result.stderr.splitlines() if "CRITICAL" in text]
            assert len(critical) == 1 and f"cannot start: {line}" in critical[0], result.stderr
            assert "loaded model" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def _can_unshare_mounts() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_mounts(), reason="a read-only root filesystem is made in a mount namespace, "
                                                      "which needs root (CAP_SYS_ADMIN): the project's machines run "
                                                      "the tests as root")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_read_only_root_filesystem_serves_over_http_and_grpc(repository, workers):
    """As a container with `readOnlyRootFilesystem` (no writable /tmp): /dev/shm is its own mount. Before, the
    start failed: ONNX Runtime's log was captured in a temporary file (`ATTEND_DEVICE=auto`), and the workers'
    metrics and graph times went into temporary folders ("No usable temporary directory found")."""
    import tritonclient.grpc as grpcclient

    read_only = ["unshare", "-m", "sh", "-c", 'mount -o remount,bind,ro / && exec "$@"', "read-only"]
    assert subprocess.run([*read_only, "sh", "-c", "! touch /tmp/attend-writable"]).returncode == 0
    port = free_port()
    with running_service(repository, prefix=read_only, ATTEND_DEVICE="auto", ATTEND_WORKERS=workers,
                         ATTEND_GRPC_PORT=str(port), ATTEND_LOG_LEVEL="info") as (url, proc):
        response = httpx.post(f"{url}/attend", json=_README_REQUEST, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == [[[1.0, 2.0]], [[2.0, 3.0]]]
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            inputs = [grpcclient.InferInput(name, list(np.shape(value)), "FP32").set_data_from_numpy(
                np.array(value, np.float32)) for name, value in _README_REQUEST.items() if name in ("queries", "keys",
                                                                                                "values")]
            lens = grpcclient.InferInput("valid_lens", [2], "INT64").set_data_from_numpy(np.array([2, 3]))
            result = client.infer("dot_product", [*inputs, lens])
            assert result.as_numpy("outputs").tolist() == [[[1.0, 2.0]], [[2.0, 3.0]]]
        scrape = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()  # with workers, from the shared folder
        for protocol in ("http", "grpc"):
            assert f'attend_requests_total{{model="dot_product",protocol="{protocol}",status="200"}} 1.0' in scrape


@pytest.mark.skipif(not _can_unshare_mounts(), reason="a read-only root filesystem is made in a mount namespace, "
                                                      "which needs root (CAP_SYS_ADMIN): the project's machines run "
                                                      "the tests as root")
def test_workers_with_no_writable_folder_at_all_stop_the_start_in_one_line(repository):
    no_shm = ["unshare", "-m", "sh", "-c",
              'mount -o remount,bind,ro / && mount -t tmpfs -o ro tmpfs /dev/shm && exec "$@"', "read-only"]
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_WORKERS": "2", "ATTEND_GRPC_PORT": "0",
                        "ATTEND_PORT": str(free_port())}
    result = subprocess.run([*no_shm, sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    critical = [line for line in result.stderr.splitlines() if "CRITICAL" in line]
    assert result.returncode == 1 and len(critical) == 1, result.stderr
    assert critical[0].endswith("cannot start: ATTEND_WORKERS > 1 needs a writable folder for the graphs' times: "
                                "TMPDIR, /tmp or /dev/shm"), result.stderr
    assert "Traceback" not in result.stderr and "loaded model" not in result.stderr


@pytest.mark.parametrize("open_connections, said", [("4096", True), ("50", False)])
def test_a_file_limit_short_of_the_open_connections_is_said_at_the_start(repository, tmp_path, open_connections,
                                                                          said):
    """Before, nothing said it: past the limit uvloop closed each new connection unanswered (its spare-descriptor
    trick), with no log line and no refusal counted. 50 connections and the process's own fit in 200."""
    log = tmp_path / "service.log"
    with running_service(repository, prefix=["prlimit", "--nofile=200:200"], log_path=log,
                         ATTEND_MAX_OPEN_CONNECTIONS=open_connections) as (url, proc):
        assert httpx.post(f"{url}/attend", json=_README_REQUEST, timeout=10).status_code == 200
    warned = [line for line in log.read_text().splitlines() if "(ulimit -n)" in line]
    assert len(warned) == int(said), warned
    if said:  # gRPC is off (running_service): HTTP's connections alone
        assert warned[0].endswith(
            "WARNING service [-] this process may open 200 files (ulimit -n) and ATTEND_MAX_OPEN_CONNECTIONS=4096 "
            "needs up to 4160: past the limit a new connection is closed unanswered (HTTP) or waits (gRPC); raise it "
            "(docker run --ulimit nofile=N) or lower the setting"), warned


_README_REQUEST = {"model": "dot_product", "queries": [[[1, 0]], [[0, 1]]],
                   "keys": [[[1, 1], [1, 1], [1, 1]], [[1, 1], [1, 1], [1, 1]]],
                   "values": [[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, 5]]], "valid_lens": [2, 3]}


# ONNX Runtime's telemetry (1.29 and later, Linux) also stays off under CI or ORT_RUNNING_UNIT_TESTS: not here.
_WITHOUT_TELEMETRY_SWITCHES = ["env", "-u", "CI", "-u", "ORT_RUNNING_UNIT_TESTS", "-u", "XDG_CACHE_HOME"]


@pytest.mark.parametrize("opt_in", [False, True])
def test_onnx_runtimes_telemetry_is_off_unless_the_operator_turns_it_on(repository, tmp_path, opt_in):
    """Before, every start made ONNX Runtime keep a device id and queue usage events (model file names, graph
    hashes) in ~/.cache/Microsoft/DeveloperTools/.onnxruntime, for Microsoft's collector wherever it can reach
    it. ORT_DISABLE_TELEMETRY=0 is the opt-in, and shows that the folder is where this test looks."""
    home = tmp_path / "home"
    home.mkdir()
    # This process imported the service, whose default is in its environment: the service must set it itself.
    prefix = _WITHOUT_TELEMETRY_SWITCHES + ([] if opt_in else ["-u", "ORT_DISABLE_TELEMETRY"])
    env = {"HOME": str(home)} | ({"ORT_DISABLE_TELEMETRY": "0"} if opt_in else {})
    with running_service(repository, prefix=prefix, **env) as (url, proc):
        assert httpx.post(f"{url}/attend", json=_README_REQUEST, timeout=10).status_code == 200
    assert (home / ".cache" / "Microsoft" / "DeveloperTools" / ".onnxruntime").is_dir() == opt_in


def test_skip_broken_models_serves_the_rest_and_says_why(repo_copy, settings):
    _wrong_sha(repo_copy)
    skip = settings.model_copy(update={"model_repository": repo_copy, "skip_broken_models": True})
    with TestClient(create_app(skip)) as client:
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert models["additive"]["status"] == "unavailable"
        assert "sha256 of" in models["additive"]["reason"]
        assert models["dot_product"]["status"] == "ready"
        response = client.post("/attend", json={"model": "additive", "queries": [[[0.0] * 20]]})
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_unavailable"
        assert client.get("/health/ready").status_code == 503  # a model that should be served is not


def test_a_model_skipped_at_start_is_unavailable_in_the_index_with_its_reason(repo_copy):
    """Its version failed (SIGHUP, the poll and the start's catch-up wait for a new one), as a failed load's."""
    _wrong_sha(repo_copy)
    registry = Registry.load(repo_copy, "cpu", 1, skip_broken=True)
    assert [(r["version"], r["state"]) for r in registry.index() if r["name"] == "additive"] == [("1", "UNAVAILABLE")]
    assert "sha256 of" in registry.index()[0]["reason"]


def test_nothing_servable_is_an_error_even_when_skipping(repo_copy):
    for name in ("additive", "dot_product", "masked_softmax", "multi_head", "positional_encoding", "self_attention"):
        (repo_copy / name / "1" / "model.onnx").write_bytes(b"x")
    with pytest.raises(StartupError, match="no model of .* can be served"):
        Registry.load(repo_copy, "cpu", 1, skip_broken=True)


def test_sigterm_under_load_drops_no_request_in_flight(repository):
    rng = np.random.default_rng(0)
    # Heavy enough that several are still running when the signal comes (one core, one thread).
    body = json.dumps({"model": "dot_product", "queries": rng.normal(size=(8, 256, 64)).tolist(),
                       "keys": rng.normal(size=(8, 256, 64)).tolist(),
                       "values": rng.normal(size=(8, 256, 64)).tolist()})
    results: list = []
    # A budget for all twelve at once (each ~70 MB to serve): this is about the stop, not the budget.
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1", ATTEND_INFERENCE_THREADS="1",
                         ATTEND_GRACE_PERIOD_S="60", ATTEND_MAX_INFLIGHT_BYTES=str(4 << 30)) as (url, proc):
        def send():
            try:
                r = httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"},
                               timeout=60)
                results.append((r.status_code, time.monotonic(), np.shape(r.json().get("outputs"))))
            except httpx.HTTPError as e:
                results.append((type(e).__name__, time.monotonic(), None))

        threads = [threading.Thread(target=send) for _ in range(12)]  # ~50 ms each
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the server holds every request
            metrics = httpx.get(f"{url}/metrics").text
            in_flight = next(float(x.split()[-1]) for x in metrics.splitlines()
                             if x.startswith("attend_requests_in_flight"))
            if in_flight >= 4:
                break
            time.sleep(0.02)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.HTTPError):  # the listener is closed (0.5 s after): new requests are refused
            httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"}, timeout=5)
        for t in threads:
            t.join(timeout=60)
        code = proc.wait(timeout=60)
        exited_after = time.monotonic() - sigterm_at
    assert [r[0] for r in results] == [200] * 12, results  # zero dropped
    assert all(r[2] == (8, 256, 64) for r in results)
    assert sum(r[1] > sigterm_at for r in results) >= 1  # some really were in flight at the signal
    assert code in (0, -signal.SIGTERM)
    assert exited_after < 60
