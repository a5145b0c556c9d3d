"""POST /attend with requests: the book's toy dot-product request, with a timeout and the service's
error body printed when it refuses the request.

    ATTEND_URL=http://127.0.0.1:8000 python docs/examples/attend_requests.py [MODEL]

MODEL (default dot_product) names the model to ask; `additive` shows a refusal: its queries have 20
features, the toy's 2, so the service answers 422 with
`{"error": {"code": "invalid_shape", "message", "field", "expected", "received"}}` (docs/errors.md has
every code). Exit status: 0 answered, 1 refused (4xx/5xx), 2 no answer (unreachable, timed out).
ATTEND_API_KEY, where the service has ATTEND_API_KEYS, is sent as `Authorization: Bearer <key>`.
tests/service/test_examples.py runs this file against the real service and checks what it prints.
"""

import json
import os
import sys

import requests

URL = os.environ.get("ATTEND_URL", "http://127.0.0.1:8000")
KEY = os.environ.get("ATTEND_API_KEY")


def main(model: str = "dot_product") -> int:
    body = {
        "model": model,
        "queries": [[[1, 0]], [[0, 1]]],
        "keys": [[[1, 1], [1, 1], [1, 1]], [[1, 1], [1, 1], [1, 1]]],
        "values": [[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, 5]]],
        "valid_lens": [2, 3],
    }
    headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}
    try:
        # (connect, read) timeouts in seconds. The service has its own deadline too (ATTEND_REQUEST_TIMEOUT_S,
        # 504 past it); X-Request-Timeout-Ms shortens it for this request, so a request the client gives up
        # on is not run for nobody.
        response = requests.post(f"{URL}/attend", json=body, timeout=(3.05, 30),
                                 headers=headers | {"X-Request-Timeout-Ms": "30000"})
    except requests.Timeout:
        print(f"no answer from {URL} within the timeout", file=sys.stderr)
        return 2
    except requests.ConnectionError as e:
        print(f"cannot reach {URL}: {e} (is `make serve` running? ATTEND_URL names another address)",
              file=sys.stderr)
        return 2
    request_id = response.headers.get("X-Request-ID")
    if not response.ok:
        try:
            error = response.json()["error"]  # {"code", "message", and where a field is at fault "field", ...}
        except (ValueError, KeyError, TypeError):
            error = {"code": None, "message": response.text}
        print(f"refused: HTTP {response.status_code}, request id {request_id}")
        print("error:", json.dumps(error))
        if "Retry-After" in response.headers:  # 503: overloaded or not ready yet; worth a retry then
            print("retry after:", response.headers["Retry-After"], "s")
        return 1
    answer = response.json()
    print("request id:", request_id)
    print("model:", answer["model"], "version:", answer["model_version"], "header:",
          response.headers.get("X-Model-Version"))
    print("outputs:", json.dumps(answer["outputs"]))
    print("attention_weights:", json.dumps(answer["attention_weights"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
