"""ModelInferRequest -> the core's `Request`, and its answer -> ModelInferResponse: the Open Inference
Protocol's gRPC form, through the same checks as its HTTP form (service.protocols.v2: an input's name,
shape and datatype, binary tensors, the requested outputs, /attend's checks of the arrays).

    inputs[i].contents      typed: fp32_contents (FP32), fp64_contents (FP64), int64_contents (INT64),
                            int_contents (INT32); FP16 only as raw bytes
    raw_input_contents[i]   raw little-endian bytes of inputs[i], for every input or none (as Triton)
    shared_memory_*         an input's data, or where an output goes, in system shared memory (those
                            inputs have no raw_input_contents; those outputs an empty one)
    outputs                 the outputs asked for (all where none is named), always as
                            raw_output_contents (FP32), in the order asked

The metadata, configuration and statistics messages are the dicts that HTTP serves as JSON, parsed
into their messages (`message_from`): one source for both protocols.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf import json_format

from service.core.batching import Encoder
from service.core.cost import Cost, binary_decode
from service.core.errors import ServiceError
from service.core.exchange import Answer
from service.core.request import Request, RequestLimits, find_model
from service.core.runtime import LoadedModel
from service.core.shm import OutputRegion
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.status import details_of
from service.grpc.wire import Received, varint
from service.protocols.v2 import (
    BadRequest,
    SharedReads,
    binary_tensor,
    input_dtype,
    input_named,
    input_shape,
    requested,
    tensors_request,
    timeout_s,
)

GRPC = b"application/grpc"
# The typed contents field of each datatype a model's input accepts (FP16 has none: raw bytes only).
_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT64": "int64_contents", "INT32": "int_contents"}


def message_from(data: dict[str, Any], message: Any) -> Any:
    """`message` filled from the JSON-shaped dict of HTTP's answer (field names as the proto's)."""
    return json_format.ParseDict(data, message, ignore_unknown_fields=True)


class GrpcCodec:
    """ModelInfer's codec (service.core.exchange.Codec): the body is the message, deserialized already by
    grpc; errors are a status code and its details (service.grpc.status). `stream`: the answer is
    ModelStreamInfer's message, its ModelInferResponse made in place (wrapping it afterwards copies it)."""

    def __init__(self, stream: bool = False):
        self.stream = stream

    def check_media_type(self, headers: Any) -> None:
        return None  # grpc checked it

    def expected(self, headers: Any, length: int) -> int:
        return 0  # the message is decoded already: what is left is held as the tensors are made

    def aligned_at(self, headers: Any) -> None:
        return None

    def decode(self, core: Any, target: Any, headers: Any, received: Received, cost: Cost
               ) -> tuple[Request, Encoder]:
        """The request of the message `received` and its answer's encoder. Raises ServiceError subclasses, with
        `.model` set once the model is known."""
        message = received.message
        model = find_model(core.registry, message.model_name, message.model_version or None, "model_name",
                           "model_version")
        try:
            shm = SharedReads(core.regions, core.inline_decode_bytes, core.loop_thread)
            return decode_for(model, message, core.limits, cost, self.stream, shm, received.raw_input_contents,
                              received.typed)
        except ServiceError as e:
            e.model = model.name
            raise

    def error_body(self, error: ServiceError) -> bytes:
        return details_of(error).encode()


def decode_for(model: LoadedModel, message: pb.ModelInferRequest, limits: RequestLimits, cost: Cost | None = None,
               stream: bool = False, shm: SharedReads | None = None, raw: list[memoryview] | None = None,
               typed: dict[tuple[int, str], list[memoryview]] | None = None) -> tuple[Request, Encoder]:
    """`shm`: the shared memory it may name (none: system shared memory is off); `raw` and `typed`: the
    message's raw_input_contents and packed contents, where they were lifted out of it
    (service.grpc.wire.Received)."""
    shm = shm or SharedReads(None, 0, None)
    inputs = message.inputs
    raw = message.raw_input_contents if raw is None else raw
    if raw and len(raw) != len(inputs):  # one each, unless some are in shared memory
        in_regions = sum("shared_memory_region" in t.parameters for t in inputs)
        if len(raw) != len(inputs) - in_regions:
            which, such = (" not in shared memory", "such ") if in_regions else ("", "")
            raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(inputs) - in_regions} "
                             f"inputs{which}: give every {such}input's data there, in the order of inputs, or none")
    seen: set[str] = set()
    tensors: dict[str, np.ndarray] = {}
    i = 0  # the next of raw_input_contents: one an input not in shared memory
    for index, tensor in enumerate(inputs):
        name = input_named(tensor.name, model, seen)
        shape = input_shape(list(tensor.shape), name)
        datatype = tensor.datatype
        dtype = input_dtype(datatype, name, model)
        parameters = tensor.parameters
        if "shared_memory_region" in parameters:
            if tensor.HasField("contents"):
                raise BadRequest(f"input {name} has contents and a shared_memory_region: send one")
            region, size, offset = _shm_parameters(parameters, f"input {name}")
            tensors[name] = shm.tensor(region, size, offset, name, shape, datatype, dtype, cost)
        elif raw:
            if tensor.HasField("contents"):
                raise BadRequest(f"input {name} has both contents and raw_input_contents[{i}]: send one")
            tensors[name] = binary_tensor(raw[i], name, shape, datatype, dtype, cost, f"raw_input_contents[{i}]")
            i += 1
        else:
            lifted = typed.get((index, _CONTENTS.get(datatype, ""))) if typed else None
            tensors[name] = _typed(tensor, name, shape, datatype, dtype, cost, lifted)
    names = [n for n, _ in requested([{"name": o.name} for o in message.outputs] or None, model, True)]
    request = tensors_request(model, tensors, names, limits)
    request.held = cost.base if cost is not None else 0  # the message lives as long as the call
    request.text_answer = False  # raw_output_contents: bytes
    if "timeout" in message.parameters:
        request.timeout_s = _timeout(message.parameters["timeout"])
    targets = {o.name: shm.target(*_shm_parameters(o.parameters, f"output {o.name}"), o.name, request)
               for o in message.outputs if "shared_memory_region" in o.parameters}
    return request, _encoder(names, message.id, stream, targets)


def _shm_parameters(parameters: Any, what: str) -> tuple[str, int, int]:
    """shared_memory_region, _byte_size and _offset (0 where not given) of an input or output."""
    def value(name: str, kind: str, required: bool = True) -> Any:
        if name not in parameters:
            if required:
                raise BadRequest(f"{what}: shared_memory_region needs {name}")
            return 0
        given = parameters[name].WhichOneof("parameter_choice")
        if given not in (kind, "uint64_param" if kind == "int64_param" else kind):
            raise BadRequest(f"{what}: {name} must be a {kind}, got {given or 'no value'}")
        return getattr(parameters[name], given)

    return (value("shared_memory_region", "string_param"), value("shared_memory_byte_size", "int64_param"),
            value("shared_memory_offset", "int64_param", False))


def _timeout(parameter: Any) -> float | None:
    kind = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    if value is None or value < 0:
        raise BadRequest("parameter timeout must be a non-negative int64_param (microseconds), got "
                         f"{kind or 'no value'}{f' {value}' if value is not None else ''}")
    return timeout_s(value)


def _typed(tensor: Any, name: str, shape: list[int], datatype: str, dtype: np.dtype, cost: Cost | None,
           lifted: list[memoryview] | None = None) -> np.ndarray:
    """An input's typed contents: the runs of them lifted out of the message (`lifted`), or as parsed."""
    field = _CONTENTS.get(datatype)
    if field is None:
        raise BadRequest(f"input {name}: {datatype} has no typed contents: send it as raw_input_contents")
    count = math.prod(shape)
    if lifted is not None:  # packed little-endian values, as raw contents: read in place where aligned
        if len(lifted) > 1 and cost is not None:  # the runs joined: a copy
            cost.add(sum(map(len, lifted)), f"input {name}")
        data = lifted[0] if len(lifted) == 1 else b"".join(lifted)
        if len(data) % dtype.itemsize or len(data) // dtype.itemsize != count:
            raise BadRequest(f"input {name}: contents.{field} holds {len(data) / dtype.itemsize:g} values, shape "
                             f"{shape} takes {count}")
        return binary_tensor(data, name, shape, datatype, dtype, cost, f"contents.{field}")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadRequest(f"input {name}: contents.{field} holds {len(values)} values, shape {shape} takes {count}")
    if cost is not None:  # a copy out of the message, and its cast
        cost.add(binary_decode(count, dtype.itemsize, dtype.kind == "f", True), f"input {name}")
    # np.array, not np.fromiter: fromiter made a Python object of each value (`python bench/grpc_read.py`).
    return np.array(values, dtype=dtype.newbyteorder("=")).reshape(shape)


def _encoder(names: list[str], request_id: str, stream: bool, targets: dict[str, OutputRegion]) -> Encoder:
    def encode(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool) -> Answer | ServiceError:
        response = pb.ModelInferResponse(model_name=model.name, model_version=model.version_text, id=request_id)
        raw = []
        for name in names:
            array = outputs[name]
            response.outputs.add(name=name, datatype="FP32", shape=array.shape)
            target = targets.get(name)
            if target is None:
                raw.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
                continue
            error = target.write(array)
            if error is not None:
                return error
            raw.append(b"")  # as Triton: the others' keep their places
        # With the model that answered (the batch's snapshot): its statistics count the success.
        return Answer(serialized(response, raw, stream), [], GRPC, model)

    return encode


class Wire:
    """A message serialized already: the gRPC handlers' response_serializer, and Ray Serve's proxy, call
    SerializeToString on what a method returns, a message or this."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data


def _tag(message: Any, field: str) -> bytes:
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)  # length-delimited


_RAW = _tag(pb.ModelInferResponse, "raw_output_contents")
_IN_STREAM = _tag(pb.ModelStreamInferResponse, "infer_response")


def serialized(response: pb.ModelInferResponse, raw: list[bytes], stream: bool = False) -> Wire:
    """`response` with `raw` as its raw_output_contents, in protobuf's bytes (as ModelStreamInfer's message with
    `stream`), made where the answer is encoded. upb copied each output in, then grpc serialized the message
    on the event loop, holding the GIL for both; the outputs are joined once here, the GIL free (bytes.join
    over 1 MiB). Serialized fields go in number order, raw_output_contents last: protobuf's own bytes."""
    parts = [response.SerializeToString()]
    for data in raw:
        parts += (_RAW, varint(len(data)), data)
    if stream:
        parts[:0] = (_IN_STREAM, varint(sum(map(len, parts))))
    return Wire(b"".join(parts))
