"""The HTTP service: FastAPI + ONNX Runtime over the model repository. Never imports torch."""
