"""Every inference answer names the model version that answered, in its body and in X-Model-Version, on
both protocols: with two versions loaded (ATTEND_KEEP_VERSIONS=2), each request gets the one it asked
for (or the newest), and says so."""

import shutil

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from export.cli import main as export
from service.config import Settings
from service.http.app import create_app
from service.http.schemas import toy_request


@pytest.fixture(scope="module")
def two_versions(repository, tmp_path_factory):
    """additive/1 and additive/2 (other weights) loaded side by side, in-process."""
    path = shutil.copytree(repository, tmp_path_factory.mktemp("versions") / "repo")
    for name in ("dot_product", "masked_softmax", "multi_head", "positional_encoding", "self_attention"):
        shutil.rmtree(path / name)  # additive alone: quicker to start
    settings = Settings(model_repository=path, device="cpu", intra_op_threads=1, keep_versions=2,
                        model_control=True)
    with TestClient(create_app(settings)) as client:
        assert export(["--repository", str(path), "--kind", "additive", "--seed", "7"]) == 0  # version 2
        assert client.post("/v2/repository/models/additive/load").status_code == 200
        assert client.get("/models/additive").json()["loaded_versions"] == [1, 2]
        yield client


def _v2_body(binary: bool = False) -> dict:
    toy = toy_request()
    inputs = [{"name": n, "datatype": "FP32", "shape": list(np.shape(toy[n])), "data": toy[n]}
              for n in ("queries", "keys", "values")]
    inputs.append({"name": "valid_lens", "datatype": "INT64", "shape": [2], "data": toy["valid_lens"]})
    return {"inputs": inputs, "parameters": {"binary_data_output": binary}}


@pytest.mark.parametrize("version", [None, 1, 2])
def test_attend_names_the_version_that_answered(two_versions, version):
    body = toy_request() | ({} if version is None else {"version": version})
    response = two_versions.post("/attend", json=body)
    assert response.status_code == 200, response.text
    expected = str(version or 2)  # no version: the newest
    assert response.json()["model_version"] == expected
    assert response.headers["x-model-version"] == expected


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("version", [None, 1, 2])
def test_v2_names_the_version_that_answered(two_versions, version, binary):
    path = "/v2/models/additive/infer" if version is None else f"/v2/models/additive/versions/{version}/infer"
    response = two_versions.post(path, json=_v2_body(binary))
    assert response.status_code == 200, response.text
    expected = str(version or 2)
    assert response.headers["x-model-version"] == expected
    if binary:
        split = int(response.headers["inference-header-content-length"])
        head = orjson.loads(response.content[:split])
    else:
        head = response.json()
    assert head["model_version"] == expected


def test_the_versions_answer_differently(two_versions):
    """The header is the answering snapshot's, not a label: version 1 and 2 have different weights."""
    keys = np.random.default_rng(1).normal(size=(2, 10, 2)).round(3).tolist()  # the toy's ones weigh alike
    answers = {v: two_versions.post("/attend", json=toy_request() | {"keys": keys, "version": v}) for v in (1, 2)}
    assert not np.allclose(answers[1].json()["attention_weights"], answers[2].json()["attention_weights"])
    assert [answers[v].headers["x-model-version"] for v in (1, 2)] == ["1", "2"]


def test_errors_name_no_version(two_versions):
    response = two_versions.post("/attend", json=toy_request() | {"version": 5})
    assert response.status_code == 404 and "x-model-version" not in response.headers
