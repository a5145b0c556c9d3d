"""The HTTP service: FastAPI + ONNX Runtime over the model repository. Never imports torch."""

import os

# ONNX Runtime (1.29 and later, on Linux) keeps a device id and queues usage events for Microsoft's collector
# unless this is set before it is first imported. A server calls no one unasked; ORT_DISABLE_TELEMETRY=0 opts in.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
