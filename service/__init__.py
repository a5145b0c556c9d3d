"""The HTTP service: FastAPI + ONNX Runtime over the model repository. Never imports torch."""

import os

# ONNX Runtime (1.29 and later, on Linux) keeps a device id and queues usage events for Microsoft's collector
# unless this is set before it is first imported. A server calls no one unasked; ORT_DISABLE_TELEMETRY=0 opts in.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
# grpc's C core writes its own INFO lines to stderr, one for every connection whose TLS handshake fails: any
# client could fill the log so. Its errors still show; GRPC_VERBOSITY=INFO or DEBUG shows the rest.
os.environ["GRPC_VERBOSITY"] = os.environ.get("GRPC_VERBOSITY") or "ERROR"

# One glibc heap for every thread (service.core.memory), set before an import starts a thread (numpy's and ONNX
# Runtime's do, and uvicorn's worker its own): a thread that allocated before had a heap of its own, whose free
# end malloc_trim never gives back.
from service.core.memory import release_memory_eagerly  # noqa: E402

release_memory_eagerly()
