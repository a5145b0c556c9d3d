"""POST /attend with httpx: the book's toy dot-product request (docs/attend.md).

    ATTEND_URL=http://127.0.0.1:8000 python docs/examples/attend_httpx.py

ATTEND_API_KEY, where the service has ATTEND_API_KEYS, is sent as `Authorization: Bearer <key>`.
tests/service/test_examples.py runs this file against the real service and checks what it prints.
"""

import json
import os

import httpx

URL = os.environ.get("ATTEND_URL", "http://127.0.0.1:8000")
KEY = os.environ.get("ATTEND_API_KEY")

body = {
    "model": "dot_product",
    "queries": [[[1, 0]], [[0, 1]]],                                # (batch 2, n_q 1, d 2)
    "keys": [[[1, 1], [1, 1], [1, 1]], [[1, 1], [1, 1], [1, 1]]],   # (2, n_k 3, 2)
    "values": [[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, 5]]],  # (2, 3, value_size 2)
    "valid_lens": [2, 3],                                           # row 0 attends to 2 keys, row 1 to 3
}
headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}

with httpx.Client(base_url=URL, headers=headers, timeout=30) as client:
    response = client.post("/attend", json=body)
    response.raise_for_status()  # a 4xx/5xx: httpx.HTTPStatusError (attend_requests.py prints the error body)
    answer = response.json()

print("request id:", response.headers.get("X-Request-ID"))  # the service's log lines of this request carry it
print("model:", answer["model"], "version:", answer["model_version"])  # also the X-Model-Version header
print("outputs:", json.dumps(answer["outputs"]))
print("attention_weights:", json.dumps(answer["attention_weights"]))
