"""The infer core, below every protocol and transport: admission, readiness, the decoded-request type
and its limits, batching, ONNX Runtime, model control, metrics and logs. No web framework here
(tests/service/test_layers.py holds it to that)."""
