"""Triton's logging extension (GET/POST /v2/logging, gRPC's LogSettings) against the real process, with
tritonclient: the settings as the service's level has them; a change takes the log's lines with it (the
access lines are info's), over HTTP and gRPC; refusals that name the setting; reading takes the API key,
changing an admin's (off without admin keys, as model control); with ATTEND_WORKERS=2 every worker follows.
"""

import time

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.server import free_port, running_service

pytestmark = pytest.mark.slow

KEY, ADMIN = "log-key", "log-admin"
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
            "log_format": "default"}


def _logged(log, marker, timeout=3.0):
    """Whether a line with `marker` reaches the log within `timeout` (lines are written every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker in log.read_text():
            return True
        time.sleep(0.1)
    return False


def _error(call):
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_change_of_the_log_settings_takes_the_lines_with_it(repository, tmp_path, protocol):
    log = tmp_path / "service.log"
    port = free_port()
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info", ATTEND_GRPC_PORT=str(port),
                         ATTEND_ADMIN_KEYS=ADMIN) as (url, _):
        admin = {"authorization": f"Bearer {ADMIN}"}
        client = httpclient.InferenceServerClient(url.removeprefix("http://")) if protocol == "http" else \
            grpcclient.InferenceServerClient(f"127.0.0.1:{port}")

        def settings():
            got = client.get_log_settings()
            if protocol == "grpc":
                got = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in got.settings.items()}
            return got

        assert settings() == DEFAULTS
        assert "logging" in httpx.get(f"{url}/v2").json()["extensions"]
        httpx.get(f"{url}/v2/models/additive", headers={"x-request-id": "seen-1"})
        assert _logged(log, "[seen-1] GET /v2/models/additive 200")
        answer = client.update_log_settings({"log_info": False}, headers=admin)
        assert (answer if protocol == "http" else settings())["log_info"] is False
        assert settings() == DEFAULTS | {"log_info": False}
        assert _logged(log, "log settings changed: log_info=False")
        httpx.get(f"{url}/v2/models/additive", headers={"x-request-id": "unseen-1"})
        client.update_log_settings({"log_info": True, "log_verbose_level": 1}, headers=admin)
        assert settings() == DEFAULTS | {"log_verbose_level": 1}
        httpx.get(f"{url}/v2/models/additive", headers={"x-request-id": "seen-2"})
        assert _logged(log, "[seen-2] GET /v2/models/additive 200")
        assert "unseen-1" not in log.read_text()
        client.update_log_settings({"log_verbose_level": 0}, headers=admin)
        assert settings() == DEFAULTS


def test_refusals_name_the_setting_and_changing_is_an_admin_call(repository):
    with running_service(repository, ATTEND_API_KEYS=KEY, ATTEND_ADMIN_KEYS=ADMIN) as (url, _):
        user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.get(f"{url}/v2/logging").status_code == 401
        assert httpx.get(f"{url}/v2/logging", headers=user).json() == DEFAULTS | {"log_info": False}  # warning
        assert httpx.post(f"{url}/v2/logging", json={"log_info": True}, headers=user).status_code == 401
        for body, said in [({"log_nothing": 1}, "log_nothing is not a log setting; they are log_file, log_info"),
                           ({"log_info": 1}, "log_info must be true or false"),
                           ({"log_verbose_level": -1}, "log_verbose_level must be a non-negative integer"),
                           ({"log_verbose_level": True}, "log_verbose_level must be a non-negative integer"),
                           ({"log_file": "/tmp/x"}, "log_file must be \"\": the service logs to its standard error"),
                           ({"log_format": "ISO8601"}, "log_format must be \"default\"")]:
            response = httpx.post(f"{url}/v2/logging", json=body, headers=admin)
            assert response.status_code == 400 and said in response.json()["error"], response.text
        response = httpx.post(f"{url}/v2/logging", content=b"[1]", headers=admin)
        assert response.status_code == 400 and "must be a JSON object" in response.json()["error"]
        assert httpx.get(f"{url}/v2/logging", headers=user).json() == DEFAULTS | {"log_info": False}


def test_changing_the_log_settings_is_off_without_admin_keys(repository):
    port = free_port()
    with running_service(repository, ATTEND_GRPC_PORT=str(port)) as (url, _):
        response = httpx.post(f"{url}/v2/logging", json={"log_info": True})
        assert response.status_code == 404
        assert response.json() == {"error": "changing the log settings is off: set ATTEND_ADMIN_KEYS (or "
                                            "ATTEND_MODEL_CONTROL=true on a trusted network)"}
        error = _error(lambda: grpcclient.InferenceServerClient(f"127.0.0.1:{port}").update_log_settings(
            {"log_info": True}))
        assert error.status() == "StatusCode.NOT_FOUND" and "changing the log settings is off" in error.message()


def test_every_worker_follows_a_change(repository, tmp_path):
    """Changed through one worker, the settings reach the other (a file they share, SIGHUP through the
    supervisor): requests on new connections, which reach both, log no access line after it."""
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info", ATTEND_WORKERS="2",
                         ATTEND_INTRA_OP_THREADS="1", ATTEND_MODEL_CONTROL="true") as (url, _):
        for i in range(8):
            httpx.get(f"{url}/v2/models/additive", headers={"x-request-id": f"before-{i}"})  # a new connection each
        assert _logged(log, "[before-7]")
        assert httpx.post(f"{url}/v2/logging", json={"log_info": False}).status_code == 200
        time.sleep(1.0)  # the SIGHUP through the supervisor
        for i in range(24):
            assert httpx.get(f"{url}/v2/logging").json()["log_info"] is False
            httpx.get(f"{url}/v2/models/additive", headers={"x-request-id": f"after-{i}"})
        time.sleep(0.5)
        assert "[after-" not in log.read_text()
