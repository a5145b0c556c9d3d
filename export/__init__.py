"""PyTorch to ONNX, validation, and the model repository.

Importing the package is torch-free (the service reads `export.repository`); the exporter
modules (`export.build`, `export.validate`, `export.publish`) import torch.
"""

import os

# As service/__init__.py: ONNX Runtime's telemetry off, unless ORT_DISABLE_TELEMETRY says otherwise.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
