"""Typed export errors: each names what went wrong, the CLI prints it and exits non-zero."""


class ExportError(Exception):
    """An export that must not be published."""


class CheckpointError(ExportError):
    """The checkpoint is missing, unreadable, or does not fit the model's parameters."""


class ValidationError(ExportError):
    """The exported graph failed onnx.checker or disagrees with PyTorch on a case."""
