"""Hostile input: every limit, tokens JSON does not allow, deep nesting, huge arrays, duplicate
keys, wrong content types. Each gets a 4xx in the one error body; the service stays ready."""

import json

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.http.schemas import toy_request
from tests.server import running_service

TOY = toy_request()


def nested(depth, leaf="1.0"):
    return "[" * depth + leaf + "]" * depth


@pytest.fixture(scope="module")
def tight(settings):
    """A service with small limits, to reach each of them with small bodies."""
    limits = {"max_batch": 4, "max_sequence": 16, "max_features": 128, "max_weight_elements": 1000,
              "max_body_bytes": 16 * 1024 * 1024}
    with TestClient(create_app(settings.model_copy(update=limits))) as client:
        yield client


def _dot(batch, n_q, n_k, d=2, v=2):
    return {"model": "dot_product", "queries": [[[0.0] * d] * n_q] * batch, "keys": [[[0.0] * d] * n_k] * batch,
            "values": [[[0.0] * v] * n_k] * batch}


# (id, body, status, code, field, words the message must contain)
LIMITS = [
    ("batch", _dot(5, 1, 1), 413, "field:queries", "batch is 5, over this service's limit of 4 (ATTEND_MAX_BATCH)"),
    ("n_q", _dot(1, 17, 1), 413, "field:queries", "n_q is 17, over this service's limit of 16 (ATTEND_MAX_SEQUENCE)"),
    ("n_k", _dot(1, 1, 17), 413, "field:keys", "n_k is 17, over this service's limit of 16"),
    ("features", _dot(1, 1, 1, d=129), 413, "field:queries", "the feature size of queries is 129, over this "
     "service's limit of 128 (ATTEND_MAX_FEATURES)"),
    ("value-features", _dot(1, 1, 1, v=140), 413, "field:values", "the feature size of values is 140"),
    ("weights", _dot(4, 16, 16), 413, "field:queries", "batch * heads * n_q * n_k (the attention weights) is 1024, "
     "over this service's limit of 1000 (ATTEND_MAX_WEIGHT_ELEMENTS)"),
    ("multi-head-weights", {"model": "multi_head", "queries": [[[0.0] * 100] * 14], "keys": [[[0.0] * 100] * 15],
                            "values": [[[0.0] * 100] * 15]}, 413, "field:queries", "is 1050, over"),  # 5 heads
]


@pytest.mark.parametrize("case", LIMITS, ids=[c[0] for c in LIMITS])
def test_each_limit_is_named(tight, case):
    _, body, status, field, words = case
    response = tight.post("/attend", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == "payload_too_large"
    assert error["field"] == field.split(":")[1]
    assert words in error["message"]


@pytest.mark.parametrize("case", LIMITS, ids=[c[0] for c in LIMITS])
def test_each_limit_holds_in_every_form_of_body(tight, case):
    """The same arrays as a gzip-compressed /attend body, and as the Open Inference Protocol's binary
    tensors (the shapes in its JSON header, the numbers after it): the same limit, named the same way."""
    import gzip
    import sys

    from tests.server import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from pools import v2_binary

    _, body, status, field, words = case
    response = tight.post("/attend", content=gzip.compress(json.dumps(body).encode()),
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field.split(":")[1] and words in response.json()["error"]["message"]
    path, content, header_length = v2_binary(body)
    response = tight.post(path, content=content, headers={"Inference-Header-Content-Length": str(header_length),
                                                          "Content-Type": "application/octet-stream"})
    assert response.status_code == status, response.text
    assert words in response.json()["error"], response.json()


def test_within_the_limits_is_served(tight):
    assert tight.post("/attend", json=_dot(3, 16, 16)).status_code == 200  # 768 weights


RAW = [
    ("nan", b'{"queries": [[[NaN, 1.0]]], "keys": [[[1.0, 1.0]]], "values": [[[1.0]]]}', 400, "invalid_json", None),
    ("infinity", b'{"queries": [[[Infinity]]]}', 400, "invalid_json", None),
    ("minus-infinity", b'{"queries": [[[-Infinity]]]}', 400, "invalid_json", None),
    ("overflowing-number", b'{"queries": [[[1e400]]]}', 400, "invalid_json", None),
    ("deep-100", json.dumps(TOY | {"queries": "X"}).replace('"X"', nested(100)).encode(), 422, "invalid_shape",
     "queries"),
    ("deep-100-lens", json.dumps(TOY).replace('"valid_lens": [2, 6]',
                                              '"valid_lens": ' + nested(100, "2")).encode(), 422, "invalid_shape",
     "valid_lens"),
    ("deep-5000", ('{"queries": ' + nested(5000) + "}").encode(), 400, "invalid_json", None),
    ("duplicate-key", json.dumps(TOY)[:-1].encode() + b', "valid_lens": [1, 1]}', 400, "invalid_json", "valid_lens"),
    ("duplicate-escaped-key", json.dumps(TOY)[:-1].encode() + b', "\\u0076alid_lens": [1, 1]}', 400,
     "invalid_json", "valid_lens"),
    ("string-body", b'"' + b"a" * 10000 + b'"', 400, "invalid_json", None),
    ("many-unknown-keys", json.dumps({f"k{i}": i for i in range(10000)}).encode(), 422, "invalid_request", None),
    ("million-flat", json.dumps(TOY | {"queries": "X"}).replace('"X"', "[" + ",".join(["0.5"] * 1_000_000) + "]")
     .encode(), 422, "invalid_shape", "queries"),
    ("million-features", ('{"model": "additive", "queries": [[[' + ",".join(["0.5"] * 1_000_000) + ']]], '
                          '"keys": [[[1, 1]]], "values": [[[1]]]}').encode(), 422, "invalid_shape", "queries"),
    ("strings-for-numbers", json.dumps(TOY | {"values": [[["1"] * 4] * 10] * 2}).encode(), 422, "invalid_request",
     "values"),
    ("object-for-array", json.dumps(TOY | {"keys": {"a": 1}}).encode(), 422, "invalid_request", "keys"),
]


@pytest.mark.parametrize("case", RAW, ids=[c[0] for c in RAW])
def test_hostile_bodies(tight, case):
    _, body, status, code, field = case
    response = tight.post("/attend", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == code
    if field is not None:
        assert error["field"] == field
    assert "Traceback" not in response.text


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x",
                                          "application/x-www-form-urlencoded", "application/xml"])
def test_wrong_content_types(tight, content_type):
    response = tight.post("/attend", content=json.dumps(TOY), headers={"content-type": content_type})
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_charset_and_missing_content_type_are_accepted(tight):
    assert tight.post("/attend", content=json.dumps(TOY),
                      headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    assert tight.post("/attend", content=json.dumps(TOY), headers={"content-type": ""}).status_code == 200


def test_still_ready_after_all_that(tight):
    """Every hostile body above, sent here (the tests that send them may not run first, or at all): each
    refused with its status, and then the service is still ready and serves."""
    statuses = [tight.post("/attend", json=body).status_code for _, body, *_ in LIMITS]
    statuses += [tight.post("/attend", content=body, headers={"content-type": "application/json"}).status_code
                 for _, body, *_ in RAW]
    assert statuses == [case[2] for case in (*LIMITS, *RAW)]
    ready = tight.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    answer = tight.post("/attend", json=TOY)
    assert answer.status_code == 200 and np.shape(answer.json()["outputs"]) == (2, 1, 4), answer.text


CONTROL = ["/v2/trace/setting", "/v2/logging", "/v2/repository/index", "/v2/systemsharedmemory/region/r/register",
           "/v2/repository/models/additive/load"]


@pytest.mark.slow
def test_a_control_calls_body_is_bounded_by_what_it_takes(repository):
    """The settings, the index, a region's register and a load read their bodies under 64 KiB, declared or
    chunked (Starlette's request.body() reads any size; a settings body is parsed on the event loop), in a real
    process."""
    with running_service(repository, ATTEND_MODEL_CONTROL="true", ATTEND_SHARED_MEMORY="true") as (url, _):
        for path in CONTROL:
            for content in (b" " * 65537, iter([b" " * 8192] * 9)):  # declared, then chunked (72 KiB)
                response = httpx.post(f"{url}{path}", content=content)
                assert response.status_code == 413, (path, response.text)
                said = "has 65537 bytes; the limit is 65536" if isinstance(content, bytes) else \
                    "is over the limit of 65536 bytes"
                assert response.json() == {"error": f"the body {said} (a control call's limit)"}, path
        assert httpx.post(f"{url}/v2/trace/setting", json={"trace_level": ["OFF"]}).json()["trace_level"] == ["OFF"]
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
