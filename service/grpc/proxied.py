"""What Ray Serve's gRPC proxy registers (service.serve.GRPC_SERVICER): the service's RPCs, each request checked
before the proxy parses it. Imported in the proxy's process, so it imports no more than that takes."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.core.errors import ServiceError
from service.grpc import guard
from service.grpc.proto import grpc_service_pb2_grpc as pb_grpc


class Refused:
    """What Serve's proxy hands the replica in place of a request it would not parse: the refusal."""

    def __init__(self, error: ServiceError):
        self.error = error


def add_servicer(servicer: Any, server: Any) -> None:
    """GRPC_SERVICER: the generated registration, each request checked before it is parsed, as
    `python -m service`'s guard checks it (service.grpc.guard.MessageCheck): Serve's proxy parses each
    request, and 32 MiB of empty inputs took 2.1 s and 1.3 GiB. Its packed integers may take parsed what the
    proxy takes on the wire (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE: the proxy has no ATTEND_* settings), not 8 times
    that; the replica's own limits bound the rest."""
    taken = guard.Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, taken)
    check = guard.MessageCheck(_proxy_limit(), "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE")
    check.add(taken.handlers)
    handlers = {name: handler._replace(request_deserializer=_checked(check, name, handler.request_deserializer))
                for name, handler in taken.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(taken.service, handlers),))
    server.add_registered_method_handlers(taken.service, handlers)


def _proxy_limit() -> int:
    """What Serve's gRPC proxy takes a message, as Ray reads it (ray.serve._private.constants)."""
    from ray.serve._private.constants import RAY_SERVE_GRPC_MAX_MESSAGE_SIZE

    return int(RAY_SERVE_GRPC_MAX_MESSAGE_SIZE)


def _checked(check: guard.MessageCheck, name: str, deserialize: Any) -> Any:
    def load(message: bytes) -> Any:
        try:
            check.parsed_bytes(name, message)
            return deserialize(message)
        except DecodeError:
            return Refused(guard.not_a_message(name))
        except ServiceError as e:
            return Refused(e)

    return load
