"""Models that change while serving, against the real process under steady concurrent load (every
response checked): a new version loads with zero failed requests, every answer is the old or the new
version's and none is old once the load has returned; a broken version fails with its reason while
the old one keeps serving; unload finishes what is queued, then 404, and holds past SIGHUP and the poll;
SIGHUP does what load does."""

import json
import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from export.cli import main as export
from export.repository import read_config
from tests.server import free_port, running_service
from tests.service.test_observability import parse, value

pytestmark = pytest.mark.slow

QUERIES = np.random.default_rng(0).normal(size=(2, 4, 100)).round(4).tolist()
BODY = json.dumps({"model": "multi_head", "queries": QUERIES, "keys": QUERIES, "values": QUERIES,
                   "valid_lens": [3, 4]}).encode()
ADMIN = {"Authorization": "Bearer admin-key-1"}
JSON = {"content-type": "application/json"}


@pytest.fixture
def repo(repository, tmp_path):
    """A repository of its own (the tests export new versions into it)."""
    path = shutil.copytree(repository, tmp_path / "repo")
    for name in ("additive", "dot_product", "masked_softmax", "positional_encoding", "self_attention"):
        shutil.rmtree(path / name)  # multi_head alone: quicker to start
    return path


class Load:
    """Clients sending BODY without pause, each response recorded with when it was sent."""

    def __init__(self, url: str, clients: int = 4, body: bytes = BODY, path: str = "/attend"):
        self.url, self.body, self.path = url, body, path
        self.results: list[tuple[float, float, int, object]] = []  # (sent, answered, status, outputs)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    r = http.post(self.path, content=self.body, headers={"content-type": "application/json"})
                    outputs = r.json().get("outputs") if r.status_code == 200 else r.json()
                    self.results.append((sent, time.monotonic(), r.status_code, outputs))
                except httpx.HTTPError as e:
                    self.results.append((sent, time.monotonic(), -1, repr(e)))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def _outputs(url: str) -> np.ndarray:
    return np.array(httpx.post(f"{url}/attend", content=BODY, headers={"content-type": "application/json"},
                               timeout=30).json()["outputs"])


def _version(url: str) -> int:
    return httpx.get(f"{url}/models/multi_head", timeout=10).json()["version"]


def _classify(results, old, new):
    """For each response: 'old', 'new', or what it was instead."""
    kinds = []
    for sent, answered, status, outputs in results:
        if status != 200:
            kinds.append((sent, answered, f"status {status}: {outputs}"))
        elif np.allclose(outputs, old, rtol=1e-5, atol=1e-6):
            kinds.append((sent, answered, "old"))
        elif np.allclose(outputs, new, rtol=1e-5, atol=1e-6):
            kinds.append((sent, answered, "new"))
        else:
            kinds.append((sent, answered, "neither"))
    return kinds


def test_a_new_version_loads_under_load_with_nothing_failed(repo):
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        old = _outputs(url)
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0  # version 2
        assert _version(url) == 1  # exported is not served: nothing happens until the load
        with Load(url) as load:
            response = httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60)
            assert response.status_code == 200, response.text
            loaded_at = time.monotonic()
            time.sleep(1.0)
        new = _outputs(url)
        assert not np.allclose(old, new)  # really other weights
        kinds = _classify(load.results, old, new)
        assert [k for k in kinds if k[2] not in ("old", "new")] == []  # zero failed, nothing else
        assert not [k for k in kinds if k[0] > loaded_at and k[2] == "old"]  # none old after the load returned
        assert {k[2] for k in kinds} == {"old", "new"} and len(kinds) > 50
        assert _version(url) == 2
        assert httpx.get(f"{url}/models/multi_head", timeout=10).json()["model_file"] == "2/model.cpu.onnx"
        index = httpx.post(f"{url}/v2/repository/index", headers=ADMIN).json()
        assert {(r["name"], r["version"], r["state"]) for r in index} == {("multi_head", "1", ""),
                                                                          ("multi_head", "2", "READY")}


def test_a_broken_version_fails_with_its_reason_and_the_old_keeps_serving(repo):
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        old = _outputs(url)
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0
        (repo / "multi_head" / "2" / "model.onnx").write_bytes(b"\x08\x07 not a model")
        with Load(url) as load:
            response = httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"].startswith("model multi_head: sha256 of multi_head/2/model.onnx is ")
        assert str(repo) not in response.text  # no server path in an error body
        kinds = _classify(load.results, old, old)
        assert {k[2] for k in kinds} == {"old"} and len(kinds) > 20
        assert _version(url) == 1
        models = httpx.get(f"{url}/models/multi_head").json()
        assert models["status"] == "ready" and models["version"] == 1
        states = {v["version"]: v for v in models["repository_versions"]}
        assert states["2"]["state"] == "UNAVAILABLE" and "sha256" in states["2"]["reason"]
        assert states["1"]["state"] == "READY"


def _queue_depth(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^attend_queue_depth (\S+)$", metrics, re.M).group(1))


def test_unload_finishes_the_queue_then_404(repo):
    # Requests heavy enough (tens of ms each) that, with 6 clients, some wait in the server's queue
    # when the unload arrives: watched on /metrics, not guessed from client-side clocks.
    heavy = np.random.default_rng(1).normal(size=(4, 128, 100)).round(3).tolist()
    body = json.dumps({"model": "multi_head", "queries": heavy, "keys": heavy, "values": heavy,
                       "return_weights": False}).encode()
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        old = np.array(httpx.post(f"{url}/attend", content=body, headers=JSON, timeout=30).json()["outputs"])
        with Load(url, clients=6, body=body) as load:
            deadline = time.monotonic() + 20
            while _queue_depth(url) < 1 and time.monotonic() < deadline:
                pass
            called_at = time.monotonic()
            response = httpx.post(f"{url}/v2/repository/models/multi_head/unload", headers=ADMIN, timeout=60)
            assert response.status_code == 200
            unloaded_at = time.monotonic()
            time.sleep(0.5)
        kinds = _classify(load.results, old, old)
        assert all(k[2] == "old" or k[2].startswith("status 404") for k in kinds)  # nothing else: no 5xx
        # What was queued when the unload began finished, on the model...
        assert [k for k in kinds if k[0] < called_at < k[1] and k[2] == "old"]
        # ... and once the unload has answered, the model is gone.
        after = [k for k in kinds if k[0] > unloaded_at]
        assert after and all(k[2].startswith("status 404") for k in after)
        assert httpx.get(f"{url}/models/multi_head").json()["status"] == "not loaded"
        assert httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60).status_code == 200
        assert np.allclose(httpx.post(f"{url}/attend", content=body, headers=JSON, timeout=30).json()["outputs"], old)


def test_sighup_loads_what_changed_under_load(repo):
    with running_service(repo) as (url, proc):
        old = _outputs(url)
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0
        with Load(url) as load:
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while _version(url) != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            swapped_at = time.monotonic()
            time.sleep(1.0)
        assert proc.poll() is None  # SIGHUP never ends the service
        new = _outputs(url)
        kinds = _classify(load.results, old, new)
        assert [k for k in kinds if k[2] not in ("old", "new")] == []
        assert not [k for k in kinds if k[0] > swapped_at and k[2] == "old"]
        assert {k[2] for k in kinds} == {"old", "new"}
        proc.send_signal(signal.SIGHUP)  # nothing changed: nothing happens
        time.sleep(0.5)
        assert proc.poll() is None and _version(url) == 2


def _replace_in_place(source, target):
    """Copy a version's files over another's of the same number, the graphs first, config.json last (as rsync or
    a volume's update would: a moment holds new graphs with the old config.json)."""
    for path in sorted(source.iterdir(), key=lambda p: p.name == "config.json"):
        shutil.copyfile(path, target / path.name)


def test_a_version_changed_in_place_is_reloaded_by_the_poll_under_load(repo, tmp_path):
    """Version 1's files replaced by another export's version 1 (a repository synced over the served one): the
    poll serves the new one, with nothing failed under load. Its graph broken in place, then mended (a copy
    that finished): the broken one fails with its reason while the other serves on, the mended one loads."""
    other = tmp_path / "other"
    assert export(["--repository", str(other), "--kind", "multi_head", "--seed", "7"]) == 0  # its version 1
    version = repo / "multi_head" / "1"
    original = shutil.copytree(version, tmp_path / "original")
    log = tmp_path / "service.log"
    with running_service(repo, log_path=log, ATTEND_POLL_S="0.2", ATTEND_LOG_LEVEL="info") as (url, _):
        old = _outputs(url)
        with Load(url) as load:
            _replace_in_place(other / "multi_head" / "1", version)
            shutil.copyfile(version / "config.json", repo / "multi_head" / "config.json")
            deadline = time.monotonic() + 30
            while np.allclose(_outputs(url), old) and time.monotonic() < deadline:
                time.sleep(0.05)
            swapped_at = time.monotonic()
            time.sleep(0.5)
        new = _outputs(url)
        assert not np.allclose(old, new) and _version(url) == 1
        kinds = _classify(load.results, old, new)
        assert [k for k in kinds if k[2] not in ("old", "new")] == []  # zero failed, nothing else
        assert not [k for k in kinds if k[0] > swapped_at and k[2] == "old"]
        assert {k[2] for k in kinds} == {"old", "new"}
        # The swap above may have failed a load already (the poll read new graphs beside the old config.json, as
        # _replace_in_place's docstring says; a fresh clone's run with a core busy did): wait for this write's.
        failed = ("load of model multi_head failed, version 1 still serving: model multi_head: sha256 of "
                  "multi_head/1/model.cpu.onnx is ")
        before = log.read_text().count(failed)
        (version / "model.cpu.onnx").write_bytes(b"\x08\x07 half a copy")
        deadline = time.monotonic() + 30
        while log.read_text().count(failed) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        np.testing.assert_array_equal(_outputs(url), new)  # the broken one failed; the one served serves on
        metrics = parse(httpx.get(f"{url}/metrics").text)
        assert value(metrics, "attend_model_load_failed", model="multi_head") == 1  # AttendModelLoadFailed's
        assert value(metrics, "attend_model_loads_total", model="multi_head", result="failed") >= 1
        (row,) = httpx.get(f"{url}/models/multi_head").json()["repository_versions"]
        assert row["state"] == "READY" and row["reason"].startswith(
            "serving the files loaded before; those on disk now did not load: model multi_head: sha256 of "
            "multi_head/1/model.cpu.onnx is "), row
        time.sleep(0.6)  # three polls more
        assert log.read_text().count(failed) == before + 1  # tried once, not at every poll
        _replace_in_place(original, version)
        shutil.copyfile(version / "config.json", repo / "multi_head" / "config.json")
        deadline = time.monotonic() + 30
        while not np.allclose(_outputs(url), old) and time.monotonic() < deadline:
            time.sleep(0.05)
        np.testing.assert_allclose(_outputs(url), old, rtol=1e-6)
        assert httpx.get(f"{url}/models/multi_head").json()["repository_versions"] == [
            {"version": "1", "state": "READY"}]
        metrics = parse(httpx.get(f"{url}/metrics").text)
        assert value(metrics, "attend_model_load_failed", model="multi_head") == 0
        assert value(metrics, "attend_model_loads_total", model="multi_head", result="loaded") >= 2


def test_a_load_reloads_a_version_changed_in_place_and_only_then(repo, tmp_path):
    """The load route reloads a version whose files changed on disk (Triton's load of a loaded model); one
    whose files did not change stays as it is (nothing to swap)."""
    other = tmp_path / "other"
    assert export(["--repository", str(other), "--kind", "multi_head", "--seed", "7"]) == 0
    log = tmp_path / "service.log"
    with running_service(repo, log_path=log, ATTEND_ADMIN_KEYS="admin-key-1", ATTEND_LOG_LEVEL="info") as (url, _):
        old = _outputs(url)
        load = f"{url}/v2/repository/models/multi_head/load"
        assert httpx.post(load, headers=ADMIN, timeout=60).status_code == 200  # unchanged: nothing loaded
        # Info lines are written every 0.2 s: the start's may still be queued (CI at c701953 read an empty log).
        deadline = time.monotonic() + 5
        while "ready:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text().count("loaded model multi_head") == 1
        _replace_in_place(other / "multi_head" / "1", repo / "multi_head" / "1")
        shutil.copyfile(other / "multi_head" / "config.json", repo / "multi_head" / "config.json")
        np.testing.assert_array_equal(_outputs(url), old)  # without a poll, nothing until the load
        assert httpx.post(load, headers=ADMIN, timeout=60).status_code == 200
        new = _outputs(url)
        assert not np.allclose(old, new) and _version(url) == 1
        assert httpx.get(f"{url}/models/multi_head").json()["sha256"] == read_config(other / "multi_head").variants[
            "cpu"]["sha256"]
    assert log.read_text().count("loaded model multi_head") == 2


def test_an_unload_holds_past_the_poll_and_sighup_until_a_load(repo):
    """The poll and SIGHUP load what changed, not what was unloaded (the poll brought it back within its period)."""
    with running_service(repo, ATTEND_MODEL_CONTROL="true", ATTEND_POLL_S="0.2") as (url, proc):
        assert httpx.post(f"{url}/v2/repository/models/multi_head/unload", timeout=60).status_code == 200
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)  # five polls
        assert httpx.get(f"{url}/models/multi_head").json()["status"] == "not loaded"
        assert httpx.post(f"{url}/attend", content=BODY, headers=JSON).status_code == 404
        assert httpx.post(f"{url}/v2/repository/models/multi_head/load", timeout=60).status_code == 200
        assert httpx.post(f"{url}/attend", content=BODY, headers=JSON).status_code == 200
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0  # and the poll
        deadline = time.monotonic() + 30  # loads a new version again
        while _version(url) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _version(url) == 2


def test_a_repository_gone_while_serving_is_said_once_and_followed_once_back(repo, tmp_path):
    """Before, SIGHUP and the poll passed over a repository moved away (or unmounted) in silence."""
    log = tmp_path / "service.log"
    with running_service(repo, log_path=log, ATTEND_POLL_S="0.2", ATTEND_LOG_LEVEL="info") as (url, proc):
        old = _outputs(url)
        away = repo.rename(tmp_path / "away")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)  # five polls and a SIGHUP: one line
        np.testing.assert_array_equal(_outputs(url), old)  # what is loaded serves on
        assert httpx.get(f"{url}/health/ready").status_code == 200
        assert export(["--repository", str(away), "--kind", "multi_head", "--seed", "7"]) == 0
        away.rename(repo)
        deadline = time.monotonic() + 30
        while _version(url) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _version(url) == 2
    text = log.read_text()
    gone = f"the model repository {repo} is not there: the models loaded serve on"
    assert text.count(gone) == 1 and text.count(f"the model repository {repo} is back") == 1, text
    assert text.index(gone) < text.index("is back") < text.index("loaded model multi_head (multi_head, version 2")


def test_older_versions_stay_addressable_where_kept(repo):
    with running_service(repo, ATTEND_MODEL_CONTROL="true", ATTEND_KEEP_VERSIONS="2") as (url, _):
        old = _outputs(url)
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0
        assert httpx.post(f"{url}/v2/repository/models/multi_head/load", timeout=60).status_code == 200
        pinned = json.loads(BODY) | {"version": 1}
        assert np.allclose(httpx.post(f"{url}/attend", json=pinned).json()["outputs"], old)
        assert httpx.get(f"{url}/models/multi_head").json()["loaded_versions"] == [1, 2]
        v1 = httpx.post(f"{url}/v2/models/multi_head/versions/1/infer", json={"inputs": [
            {"name": n, "datatype": "FP32", "shape": [2, 4, 100], "data": QUERIES} for n in ("queries", "keys",
                                                                                             "values")]})
        assert v1.status_code == 200 and v1.json()["model_version"] == "1"
        missing = httpx.post(f"{url}/attend", json=json.loads(BODY) | {"version": 5})
        assert missing.status_code == 404 and missing.json()["error"]["field"] == "version"


def test_model_control_is_an_admin_operation(repo):
    # Off by default: 404, and /v2 does not list the extension.
    with running_service(repo) as (url, _):
        assert httpx.post(f"{url}/v2/repository/index").status_code == 404
        assert "model_repository" not in httpx.get(f"{url}/v2").json()["extensions"]
    # Admin keys: the API keys are not enough.
    with running_service(repo, ATTEND_API_KEYS="user-key", ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        user = {"Authorization": "Bearer user-key"}
        assert httpx.post(f"{url}/v2/repository/index", headers=user).status_code == 401
        assert httpx.post(f"{url}/v2/repository/index", headers=ADMIN).status_code == 200
        assert "model_repository" in httpx.get(f"{url}/v2", headers=user).json()["extensions"]
        assert httpx.post(f"{url}/v2/repository/models/nope/load", headers=ADMIN, timeout=30).json() == {
            "error": "model nope: no such model in the repository (no nope/config.json)"}
    # A trusted network: on, with no key.
    with running_service(repo, ATTEND_MODEL_CONTROL="true") as (url, _):
        assert httpx.post(f"{url}/v2/repository/index", json={"ready": True}).json() == [
            {"name": "multi_head", "version": "1", "state": "READY", "reason": ""}]
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        client.unload_model("multi_head", unload_dependents=True)  # taken: no model depends on another
        client.load_model("multi_head")
        assert client.is_model_ready("multi_head")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_load_with_a_config_or_files_is_refused_not_ignored(repo, protocol):
    port = free_port()
    with running_service(repo, ATTEND_MODEL_CONTROL="true", ATTEND_GRPC_PORT=str(port)) as (url, _):
        client = httpclient.InferenceServerClient(url.removeprefix("http://")) if protocol == "http" else \
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as raised:
            client.load_model("multi_head", config='{"max_batch_size": 8}')
        assert "parameter 'config': a load takes no config or files: the model loads as its folder in the " \
            "repository has it" in raised.value.message()
        if protocol == "grpc":
            assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
            with pytest.raises(InferenceServerException) as raised:
                client.load_model("multi_head", files={"file:1/model.onnx": b"\0"})
            assert "parameter 'file:1/model.onnx'" in raised.value.message()
        else:
            for body, said in [({"parameters": {"file:1/model.onnx": "AA=="}}, "parameter 'file:1/model.onnx'"),
                               ({"parameters": []}, "its parameters an object"), (b"{", "not valid JSON")]:
                response = httpx.post(f"{url}/v2/repository/models/multi_head/load", **(
                    {"content": body} if isinstance(body, bytes) else {"json": body}))
                assert response.status_code == 400 and said in response.json()["error"], response.text
            response = httpx.post(f"{url}/v2/repository/models/multi_head/unload", json={"parameters": {"x": 1}})
            assert response.status_code == 400
            assert response.json() == {"error": "parameter 'x': an unload takes only unload_dependents"}
        assert client.is_model_ready("multi_head")  # nothing refused unloaded it


def frozen(url: str) -> float:
    return value(parse(httpx.get(f"{url}/metrics", timeout=10).text), "python_gc_frozen_objects")


def test_what_the_process_froze_at_start_is_collectable_again_once_a_model_is_replaced(repo):
    """python -m service freezes what it holds once started (a full collection under load then looks only at
    what came after); a load that retires a snapshot unfreezes it all, so that the retired model's cycles, if
    any, are collected; so does an unload."""
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        assert frozen(url) > 10_000  # the modules and the model
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0  # version 2
        assert httpx.post(f"{url}/v2/repository/models/multi_head/load", headers=ADMIN, timeout=60).status_code == 200
        assert frozen(url) == 0
    with running_service(repo, ATTEND_ADMIN_KEYS="admin-key-1") as (url, _):
        assert frozen(url) > 10_000
        assert httpx.post(f"{url}/v2/repository/models/multi_head/unload", headers=ADMIN, timeout=60).status_code == 200
        assert frozen(url) == 0


def test_a_sighup_while_it_starts_neither_ends_it_nor_is_lost(repository, tmp_path):
    """SIGHUP's default action ended a service still starting (an operator's SIGHUP after an export, during a
    restart). It is ignored until the server handles it, which then loads what changed while it started."""
    repo = shutil.copytree(repository, tmp_path / "repo")  # every model: a start long enough to export into
    stash = shutil.copytree(repository / "additive", tmp_path / "stash" / "additive")
    assert export(["--repository", str(stash.parent), "--kind", "additive", "--seed", "7"]) == 0
    log_path = tmp_path / "service.log"

    def meanwhile(proc) -> None:
        # Once it loads the models (no process can ignore a signal before its own code runs), after the first,
        # additive: its version 2 and SIGHUPs, while the other five load (a second or more).
        while proc.poll() is None and "loaded model additive" not in log_path.read_text():
            time.sleep(0.01)
        os.replace(stash / "2", repo / "additive" / "2")
        os.replace(stash / "config.json", repo / "additive" / "config.json")  # names the newest
        for _ in range(3):
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.02)

    def starting(proc) -> None:
        threading.Thread(target=meanwhile, args=(proc,), daemon=True).start()

    with running_service(repo, log_path=log_path, ATTEND_LOG_LEVEL="info", starting=starting) as (url, proc):
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/models/additive").json()["version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/models/additive").json()["version"] == 2
        assert proc.poll() is None
    log = log_path.read_text()
    assert "loaded model additive (additive, version 1" in log and "version 2" in log, log
    assert "Traceback" not in log


def test_a_slow_repository_never_holds_the_event_loop(settings, monkeypatch):
    """A repository on a network mount that answers slowly (or hangs): the poll, SIGHUP, a load, GET /models and
    the repository index read it on a thread, and the service answers meanwhile. Before, each model's
    config.json and files were read on the event loop (GET /models: the whole repository once a model)."""
    from fastapi.testclient import TestClient

    from service.core import runtime
    from service.http.app import create_app

    slow = threading.Event()
    stamp, versions = runtime.Loader.stamp, runtime.list_versions

    def slow_stamp(self, name):
        if slow.is_set():
            time.sleep(0.5)  # a model's config.json and files, as a slow mount reads them
        return stamp(self, name)

    def slow_versions(folder):
        if slow.is_set():
            time.sleep(0.2)  # a model's folder listed, as a slow mount lists it
        return versions(folder)

    monkeypatch.setattr(runtime.Loader, "stamp", slow_stamp)
    monkeypatch.setattr(runtime, "list_versions", slow_versions)
    with TestClient(create_app(settings)) as client, ThreadPoolExecutor(1) as another_client:
        control = client.app.state.dataplane.control
        slow.set()
        calls = [lambda: client.portal.start_task_soon(control.reload_changed),
                 lambda: client.portal.start_task_soon(control.load, "additive"),
                 lambda: another_client.submit(client.get, "/models"),
                 lambda: another_client.submit(client.get, "/models/additive")]
        for call in calls:
            running = call()
            time.sleep(0.1)  # into its reads
            assert client.get("/health/live").status_code == 200
            assert not running.done()  # answered while the repository was being read
            result = running.result(timeout=60)
            if hasattr(result, "status_code"):
                assert result.status_code == 200 and '"additive"' in result.text
        assert control.registry.get("additive") is not None
