"""Mutated good bodies against a real server: every value swapped for one of another type, keys dropped or added,
values wrapped, lists grown, through /attend and the Open Inference Protocol (JSON and binary), some padded past
1 MiB (a decode process reads those). No answer is a 5xx, every refusal is the protocol's error body, and the log
holds no traceback, no warning and no failed decode process. (It found a datatype sent as a list: a 500.)"""

import copy
import json
import os
import random

import httpx
import numpy as np
import pytest

from service.core.cost import PRECISE_BODY_BYTES
from tests.server import running_service
from tests.service.test_batching import make_body

pytestmark = pytest.mark.slow

# CI replays fixed cases; FUZZ_EXAMPLES=20000 FUZZ_RANDOM=1 explores new ones.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "600"))
SEED = random.randrange(1 << 30) if os.environ.get("FUZZ_RANDOM") else 0
KINDS = ("additive", "dot_product", "multi_head", "masked_softmax", "self_attention", "positional_encoding")
VALUES = (None, True, False, 0, 1, -1, 7, 1.5, -0.0, 1e39, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
          1e-45, "", "x", "FP32", "INT64", "FP16", "BYTES", "\u0000", "é", "a" * 300, [], {}, [1], [[1]], [1.5, "x"],
          {"a": 1}, {"binary_data_size": 4}, [None], [[[]]], {"": None}, ["FP32"], [2, 1, 20], [-1], [2**40, 2**40],
          {"name": "queries"})
KEYS = ("extra", "name", "parameters", "shape", "datatype", "data", "id", "outputs", "binary_data", "timeout",
        "valid_lens", "return_weights", "model", "classification")
PAD = b" " * (PRECISE_BODY_BYTES + 1)


def _places(node, at=()):
    yield at
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _places(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:6]):
            yield from _places(value, (*at, i))


def mutated(rng: random.Random, body):
    """`body` with one to three changes at random places."""
    body = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        at = rng.choice(list(_places(body)))
        if not at:
            continue
        parent = body
        for key in at[:-1]:
            parent = parent[key]
        key, roll = at[-1], rng.random()
        if roll < 0.55:
            parent[key] = copy.deepcopy(rng.choice(VALUES))
        elif roll < 0.7:
            del parent[key]
        elif roll < 0.8 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice(VALUES))
        elif roll < 0.9:
            parent[key] = [parent[key]]
        elif isinstance(parent[key], list) and parent[key]:
            parent[key] = parent[key] + parent[key][:1]
        else:
            parent[key] = {"x": parent[key]}
    return body


def _as_protocol(body: dict) -> tuple[str, dict]:
    inputs = [{"name": name, "datatype": "INT64" if name == "valid_lens" else "FP32",
               "shape": list(np.shape(body[name])), "data": np.ravel(body[name]).tolist()}
              for name in ("queries", "keys", "values", "scores", "valid_lens") if body.get(name) is not None]
    outputs = [{"name": "outputs"}] if body.get("return_weights") is False else []
    return body["model"], {"id": "a", "parameters": {"timeout": 10**9}, "inputs": inputs, "outputs": outputs}


def _binary(head) -> tuple[bytes, dict]:
    """`head`'s inputs' data moved after it as binary tensors, where it is still an array of numbers."""
    blobs = []
    for entry in head.get("inputs", []) if isinstance(head, dict) and isinstance(head.get("inputs"), list) else []:
        if isinstance(entry, dict) and "data" in entry:
            data = entry.pop("data")
            try:
                blob = np.asarray(data, np.int64 if entry.get("datatype") == "INT64" else np.float32).tobytes()
            except (TypeError, ValueError, OverflowError):
                blob = b"\0" * 12
            if isinstance(entry.setdefault("parameters", {}), dict):
                entry["parameters"]["binary_data_size"] = len(blob)
            blobs.append(blob)
    text = json.dumps(head).encode()
    return text + b"".join(blobs), {"Inference-Header-Content-Length": str(len(text))}


def _padded(body: bytes, headers: dict) -> tuple[bytes, dict]:
    length = headers.get("Inference-Header-Content-Length")
    if length is None:
        return body + PAD, headers
    at = int(length)
    return body[:at] + PAD + body[at:], {"Inference-Header-Content-Length": str(at + len(PAD))}


def cases(count: int, seed: int):
    """(form, path, body, headers): mutated /attend, protocol JSON and protocol binary bodies of every model and
    form of lengths; one in six padded past 1 MiB."""
    numbers = np.random.default_rng(5)
    goods = [json.loads(make_body(kind, numbers, batch, 2, 3, form)) | ({"return_weights": False} if batch == 1 else {})
             for kind in KINDS for form in ("absent", "1d", "2d") for batch in (1, 2)]
    rng = random.Random(seed)
    for i in range(count):
        good, form = rng.choice(goods), ("attend", "json", "binary")[i % 3]
        if form == "attend":
            path, (body, headers) = "/attend", (json.dumps(mutated(rng, good)).encode(), {})
        else:
            model, head = _as_protocol(good)
            head = mutated(rng, head)
            path = f"/v2/models/{model}/infer"
            body, headers = _binary(head) if form == "binary" else (json.dumps(head).encode(), {})
        if rng.random() < 1 / 6:
            body, headers = _padded(body, headers)
        yield form, path, body, headers | {"content-type": "application/json"}


def test_mutated_bodies_get_answers_or_readable_refusals(repository, tmp_path):
    log = tmp_path / "service.log"
    seen = {}
    with running_service(repository, log_path=log, ATTEND_JSON_PROCESSES="1", ATTEND_LOG_LEVEL="info") as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            for form, path, body, headers in cases(EXAMPLES, SEED):
                answer = client.post(path, content=body, headers=headers)
                code = answer.status_code
                seen[form, code // 100] = seen.get((form, code // 100), 0) + 1
                assert code < 500, (SEED, path, body[:400], answer.text)
                if code >= 400:
                    error = answer.json()["error"]
                    message = error if path.startswith("/v2") else error["message"]
                    assert isinstance(message, str) and message, answer.text
    text = log.read_text()
    for sign in ("Traceback", "Warning", "decode process failed", " 500 "):
        assert sign not in text, (SEED, text[-3000:])
    # Both answers and refusals, through every form: the mutations do not all break a body the same way.
    forms = ("attend", "json", "binary")
    assert all(seen.get((form, kind), 0) > EXAMPLES / 30 for form in forms for kind in (2, 4)), seen
