"""Triton's gRPC protocol (`inference.GRPCInferenceService`): the .proto files of
github.com/triton-inference-server/common, protobuf/grpc_service.proto and protobuf/model_config.proto
at commit 83adf7cf88a2f343005974dff3728be746de2d66 (2026-07-23), unchanged, and the stubs generated from
them by grpcio-tools 1.85.1 (protoc 35.1, protobuf 7.35 gencode):

    python scripts/grpc_stubs.py            regenerate (and --check: compare, as the tests do)

To move to a newer upstream: copy both files from the new commit, name it here, regenerate.
"""

from types import ModuleType

from . import grpc_service_pb2, model_config_pb2


def _named_by_their_module(module: ModuleType) -> None:
    """protoc names the message classes' module after the .proto file ("grpc_service_pb2"), which is not
    importable as that; pickle finds a class by its module, and Ray Serve's gRPC proxy pickles each request
    for its replica (service/serve.py). Named by the module they are in, they pickle."""
    def name(cls: type, descriptor: object) -> None:
        cls.__module__ = module.__name__
        for nested in descriptor.nested_types:  # type: ignore[attr-defined]
            name(getattr(cls, nested.name), nested)

    for message, descriptor in module.DESCRIPTOR.message_types_by_name.items():
        name(getattr(module, message), descriptor)


_named_by_their_module(grpc_service_pb2)
_named_by_their_module(model_config_pb2)
