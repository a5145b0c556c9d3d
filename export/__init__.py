"""PyTorch to ONNX, validation, and the model repository.

Importing the package is torch-free (the service reads `export.repository`); the exporter
modules (`export.build`, `export.validate`, `export.publish`) import torch.
"""
