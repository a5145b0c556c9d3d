"""The Open Inference Protocol with Triton's client (tritonclient.http), binary tensors: the book's toy
dot-product request (docs/attend.md) as /v2 inputs.

    ATTEND_URL=http://127.0.0.1:8000 python docs/examples/v2_tritonclient.py

tests/service/test_examples.py runs this file against the real service and checks what it prints.
"""

import json
import os
from urllib.parse import urlsplit

import numpy as np
import tritonclient.http as httpclient

URL = urlsplit(os.environ.get("ATTEND_URL", "http://127.0.0.1:8000"))
KEY = os.environ.get("ATTEND_API_KEY")

client = httpclient.InferenceServerClient(URL.netloc, ssl=URL.scheme == "https")  # host:port, no scheme
headers = {"Authorization": f"Bearer {KEY}"} if KEY else None
print("ready:", client.is_model_ready("dot_product", headers=headers))

arrays = {
    "queries": np.array([[[1, 0]], [[0, 1]]]),                     # (batch 2, n_q 1, d 2)
    "keys": np.ones((2, 3, 2)),                                    # (2, n_k 3, 2)
    "values": np.array([[[0, 1], [2, 3], [4, 5]]] * 2),            # (2, 3, value_size 2)
}
inputs = []
for name, array in arrays.items():
    tensor = httpclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array.astype(np.float32))  # binary by default: raw little-endian bytes after the JSON
    inputs.append(tensor)
lens = httpclient.InferInput("valid_lens", [2], "INT64")  # optional; INT32 works too
lens.set_data_from_numpy(np.array([2, 3], dtype=np.int64))
inputs.append(lens)
outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in ("outputs", "attention_weights")]

result = client.infer("dot_product", inputs, outputs=outputs, request_id="toy-1", headers=headers)
response = result.get_response()  # the JSON part: model_name, model_version, id, the outputs' shapes
print("model:", response["model_name"], "version:", response["model_version"], "id:", response.get("id"))
print("outputs:", json.dumps(result.as_numpy("outputs").tolist()))
print("attention_weights:", json.dumps(result.as_numpy("attention_weights").tolist()))
