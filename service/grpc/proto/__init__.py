"""Triton's gRPC protocol (`inference.GRPCInferenceService`): the .proto files of
github.com/triton-inference-server/common, protobuf/grpc_service.proto and protobuf/model_config.proto
at commit 83adf7cf88a2f343005974dff3728be746de2d66 (2026-07-23), unchanged, and the stubs generated from
them by grpcio-tools 1.85.1 (protoc 35.1, protobuf 7.35 gencode):

    python scripts/grpc_stubs.py            regenerate (and --check: compare, as the tests do)

To move to a newer upstream: copy both files from the new commit, name it here, regenerate.
"""
