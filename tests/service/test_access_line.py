"""The start-up log says whether API keys are required, and who may load models; it never names a key."""

import logging

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from service.config import Settings
from service.http.app import access_line, create_app


def test_the_start_up_line_says_keys_are_required(settings, caplog):
    keyed = settings.model_copy(update={"api_keys": SecretStr("first-key-123,second-key-456")})
    with caplog.at_level(logging.INFO, logger="service"), TestClient(create_app(keyed)):
        pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("API keys:")]
    assert lines == ["API keys: required (2 in ATTEND_API_KEYS) for /attend, /v2, /models, /metrics and gRPC; "
                     "the health routes and the page are open; model control: off"]
    assert "first-key-123" not in caplog.text and "second-key-456" not in caplog.text


@pytest.mark.parametrize("update, model_control, says", [
    ({}, False, "API keys: none (ATTEND_API_KEYS is empty): every route is open to whoever reaches the port; "
                "model control: off"),
    ({"admin_keys": SecretStr("admin-1")}, True, "model control: an admin key (1 in ATTEND_ADMIN_KEYS)"),
    ({"model_control": True}, True, "model control: open (ATTEND_MODEL_CONTROL=true)"),
])
def test_the_start_up_line_says_who_may_load_models(update, model_control, says):
    line = access_line(Settings(**update), model_control)
    assert line.endswith(says) and line.startswith("API keys: none")
