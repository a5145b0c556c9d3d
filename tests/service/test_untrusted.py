"""What a client sends never reaches a log line, a path or an error unescaped: log lines forged through
the path, a header, the request ID and a model's name stay one line each; model names from URLs and
bodies follow the exporter's rule and stay inside the repository; no answer shows a server path."""

from __future__ import annotations

import re
import shutil
import socket

import httpx
import pytest

from export.repository import model_dir, valid_name
from service.core.logs import escape
from tests.server import running_service

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+ \[[^\]\n]*\] ")
FORGED = "2026-01-01 00:00:00,000 CRITICAL service [-] forged"


def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                break
    return data


def test_forged_log_lines_stay_one_line(repository, tmp_path):
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info", ATTEND_MODEL_CONTROL="true") as (url, _):
        # The path: percent-decoded by the server, logged as the client sent it.
        assert httpx.get(f"{url}/x%0a{FORGED.replace(' ', '%20')}").status_code == 404
        assert httpx.post(f"{url}/v2/models/a%0d%0a{FORGED.replace(' ', '%20')}/infer", content=b"{}").status_code \
            == 404
        # A request ID with control characters never gets in (HTTP's parser refuses the header); one with
        # anything but a token's characters is not taken (one is made up).
        for rid in ("abc\x1b[31mred", "abc\x0bdef"):
            answer = _raw(url, f"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Request-ID: {rid}\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 400 ") and rid.encode() not in answer, answer
        response = httpx.get(f"{url}/health/live", headers={"X-Request-ID": f"a b <{FORGED}>"})
        assert response.status_code == 200 and "forged" not in response.headers["x-request-id"]
        # A header the service writes into an error message (control characters: the parser refuses them),
        # and a model's name it logs (model control).
        assert httpx.post(f"{url}/attend", content=b"{}", headers={"content-type": f"text/x <{FORGED}>"}) \
            .status_code == 415
        assert httpx.post(f"{url}/v2/repository/models/m%0a{FORGED.replace(' ', '%20')}/load").status_code == 400
        assert httpx.post(f"{url}/v2/repository/models/nothere/load").status_code == 400
    text = log.read_text()
    assert "forged" in text  # the attempts are logged...
    lines = text.splitlines()
    assert all(LINE.match(line) for line in lines), [line for line in lines if not LINE.match(line)]
    assert not any(line.startswith(FORGED) for line in lines)  # ... and none is a line of its own
    assert "\x1b" not in text and "\x0b" not in text and "\r" not in text


@pytest.mark.parametrize("text, logged", [("plain /path ok", "plain /path ok"), ("a\nb", "a\\nb"),
                                          ("a\r\nb", "a\\r\\nb"), ("\x1b[31m", "\\x1b[31m"),
                                          ("é ü 漢", "é ü 漢"), ("\u2028", "\\u2028")])
def test_escape(text, logged):
    assert escape(text) == logged


@pytest.mark.parametrize("name", ["..", ".", "../etc", "a/b", "a\\b", "", " x", "x" * 65, "a\x00", "~root", "-x"])
def test_names_that_are_not_a_models(name, tmp_path):
    assert not valid_name(name)
    assert model_dir(tmp_path, name) is None


def test_a_name_may_not_lead_out_of_the_repository_by_a_link(tmp_path):
    repository = tmp_path / "repo"
    repository.mkdir()
    (repository / "inside").mkdir()
    (repository / "outside").symlink_to(tmp_path)
    assert model_dir(repository, "inside") == repository / "inside"
    assert model_dir(repository, "outside") is None


def test_links_inside_the_repository_serve_and_one_out_of_it_is_said(repository, tmp_path):
    """A repository that is a link (KServe's modelcar) and model folders linked inside it are served. A folder
    linked out of it stopped the start with "'additive' is not a model's name"; now it says what is wrong."""
    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    shutil.copytree(repository / "dot_product", real / "..data" / "dot_product")  # hidden: not a model itself
    (real / "dot_product").symlink_to("..data/dot_product")
    shutil.copytree(repository / "additive", elsewhere / "additive")
    (real / "additive").symlink_to(elsewhere / "additive")
    (tmp_path / "models").symlink_to(real)
    said = ("model additive: its folder links out of the repository; a model's folder must be inside it (copy the "
            "folder in, or make the repository itself the link)")
    log = tmp_path / "service.log"
    with running_service(tmp_path / "models", log_path=log, ready_path="/health/live",  # ready: 503, one broken
                         ATTEND_SKIP_BROKEN_MODELS="true", ATTEND_MODEL_CONTROL="true") as (url, _):
        assert httpx.post(f"{url}/v2/repository/index").json() == [
            {"name": "additive", "version": "", "state": "UNAVAILABLE", "reason": said},
            {"name": "dot_product", "version": "1", "state": "READY", "reason": ""}]
        load = httpx.post(f"{url}/v2/repository/models/additive/load")
        assert (load.status_code, load.json()) == (400, {"error": said})
        response = httpx.post(f"{url}/attend", json={"model": "dot_product", "queries": [[[1.0, 0.0]]],
                                                    "keys": [[[1.0, 0.0], [0.0, 1.0]]],
                                                    "values": [[[1.0], [3.0]]], "valid_lens": [1]})
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == [[[1.0]]]
    assert f"ERROR service [-] skipping model additive: {said}" in log.read_text()


@pytest.mark.parametrize("name", ["%2e%2e", "..%2fetc", "a%5cb", "%2e", "x%00y"])
def test_model_control_refuses_names_from_urls_without_a_path(repository, name):
    with running_service(repository, ATTEND_MODEL_CONTROL="true") as (url, _):
        for action in ("load", "unload"):
            response = httpx.post(f"{url}/v2/repository/models/{name}/{action}")
            assert response.status_code in (400, 404), response.text
            message = response.json()["error"]
            assert "is not a model's name" in message or response.status_code == 404, message
            assert str(repository) not in message and "config.json" not in message and "/" not in message.split(
                "GET /models")[0].replace("'", ""), message
        assert httpx.get(f"{url}/health/ready").status_code == 200


def test_names_in_bodies_and_paths_follow_the_rule(client):
    response = client.post("/attend", json={"model": "../additive", "queries": [[[1.0]]]})
    assert response.status_code == 404
    assert response.json()["error"]["message"].startswith("'../additive' is not a model's name")
    response = client.post("/v2/models/%2e%2e/infer", content=b"{}")
    assert response.status_code == 404 and "is not a model's name" in response.json()["error"]
