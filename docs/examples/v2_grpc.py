"""The Open Inference Protocol over gRPC with Triton's client (tritonclient.grpc): the book's toy
dot-product request (docs/attend.md) as ModelInfer's inputs, sent as raw_input_contents.

    ATTEND_URL=http://127.0.0.1:8000 python docs/examples/v2_grpc.py

The address is the one every example reads: the host of ATTEND_URL (default http://127.0.0.1:8000).
The port is the service's gRPC port, ATTEND_GRPC_PORT (default 8001). A HOST:PORT argument overrides both.
ATTEND_API_KEY, where the service has ATTEND_API_KEYS, is sent as `authorization: Bearer <key>` metadata.
tests/service/test_examples.py runs this file against the real service and checks what it prints.
"""

import json
import os
import sys
from urllib.parse import urlsplit

import numpy as np
import tritonclient.grpc as grpcclient

HOST = urlsplit(os.environ.get("ATTEND_URL", "http://127.0.0.1:8000")).hostname
ADDRESS = sys.argv[1] if len(sys.argv) > 1 else f"{HOST}:{os.environ.get('ATTEND_GRPC_PORT', '8001')}"
KEY = os.environ.get("ATTEND_API_KEY")

client = grpcclient.InferenceServerClient(ADDRESS)  # host:port, no scheme
headers = {"authorization": f"Bearer {KEY}"} if KEY else None  # gRPC metadata: lower-case names
print("ready:", client.is_model_ready("dot_product", headers=headers))

arrays = {
    "queries": np.array([[[1, 0]], [[0, 1]]]),                     # (batch 2, n_q 1, d 2)
    "keys": np.ones((2, 3, 2)),                                    # (2, n_k 3, 2)
    "values": np.array([[[0, 1], [2, 3], [4, 5]]] * 2),            # (2, 3, value_size 2)
}
inputs = []
for name, array in arrays.items():
    tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array.astype(np.float32))  # raw little-endian bytes (raw_input_contents)
    inputs.append(tensor)
lens = grpcclient.InferInput("valid_lens", [2], "INT64")  # optional; INT32 works too
lens.set_data_from_numpy(np.array([2, 3], dtype=np.int64))
inputs.append(lens)
outputs = [grpcclient.InferRequestedOutput(name) for name in ("outputs", "attention_weights")]

result = client.infer("dot_product", inputs, outputs=outputs, request_id="toy-1", headers=headers,
                      client_timeout=10)  # seconds: the call's deadline (grpc-timeout), the service's too
response = result.get_response()  # ModelInferResponse: model_name, model_version, id, the outputs' shapes
print("model:", response.model_name, "version:", response.model_version, "id:", response.id)
print("outputs:", json.dumps(result.as_numpy("outputs").tolist()))
print("attention_weights:", json.dumps(result.as_numpy("attention_weights").tolist()))
