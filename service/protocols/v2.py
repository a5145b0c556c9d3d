"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST protocol) with its binary tensor data
extension: the codec, nothing else. Inference requests become the same `Request` as /attend's and go
through the same dataplane (batching with /attend's requests, limits, deadlines, metrics, keys).

    POST /v2/models/{m}[/versions/{v}]/infer   JSON tensors ("data" flat or nested), or a JSON header
                                               (Inference-Header-Content-Length) and raw little-endian bytes;
                                               any input or output in system shared memory (SharedReads)

Errors are the protocol's `{"error": "<message>"}` with the status. Every size a client states is
checked against the body before a byte of it is read as a tensor. Model metadata and Triton's model
configuration are here too (`metadata`, `config`): the routes of service.http.routes.v2 serve them.
"""

from __future__ import annotations

import math
import threading
from typing import Any
from urllib.parse import unquote

import numpy as np
import orjson
import simdjson

from service.core.batching import Encoder
from service.core.cost import PRECISE_BODY_BYTES, Cost, binary_decode, json_counts, json_decode
from service.core.deadline import on_thread
from service.core.errors import (
    InvalidJSON,
    ModelNotFound,
    ServiceError,
    UnsupportedMediaType,
    excerpt,
    json_type,
)
from service.core.jobs import SizePlan
from service.core.request import MAX_DIMS, Request, RequestLimits, build_request, find_model
from service.core.runtime import LoadedModel
from service.core.shm import Offload, OutputRegion, Regions, SharedMemoryOff
from service.protocols.codec import JSON, OCTETS, Answer, Headers, Target, json_parts, media_type
from service.protocols.json_arrays import large_not_json
from service.protocols.json_process import Raised, given, stand_in

_V2_TYPE = {"float32": "FP32", "int64": "INT64"}
# What a client may send for each input dtype of the signature: converted to it, or refused.
_ACCEPTED = {"float32": {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "FP64": np.dtype("<f8")},
             "int64": {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4")}}
# A tuple, not a set: a datatype sent as a list or an object is compared, not hashed.
_INTEGERS = tuple(t for accepted in _ACCEPTED.values() for t, dtype in accepted.items() if dtype.kind == "i")


class BadRequest(InvalidJSON):
    """An Open Inference Protocol request it cannot read: its JSON, or an input's name, datatype, shape or data."""

    advice = "The message names the input and what is wrong; GET /v2/models/{m} lists its inputs and datatypes."


def error_json(error: ServiceError) -> bytes:
    return orjson.dumps({"error": error.message})


# --------------------------------------------------------------------------------------- metadata


def extensions(model_repository: bool, shared_memory: bool = False) -> list[str]:
    """The server metadata's `extensions` (every transport's: HTTP's GET /v2, gRPC's ServerMetadata):
    binary tensors, Triton's statistics, logging and trace settings, and the model repository and system shared
    memory where they are on."""
    return ["binary_tensor_data", "statistics", "logging", "trace", *(["model_repository"] if model_repository else []),
            *(["system_shared_memory"] if shared_memory else [])]


def _dims(shape: tuple) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def _batched(model: LoadedModel) -> bool:
    """Whether every input and output has the batch axis first (Triton's max_batch_size > 0)."""
    return all(s.shape[0] == "batch" for s in (*model.inputs(), *model.outputs))


def metadata(model: LoadedModel) -> dict[str, Any]:
    def tensor(spec) -> dict[str, Any]:
        return {"name": spec.name, "datatype": _V2_TYPE[spec.dtype], "shape": _dims(spec.shape)}

    return {"name": model.name, "versions": [str(model.config.version)], "platform": "onnxruntime_onnx",
            "inputs": [tensor(s) for s in model.inputs()], "outputs": [tensor(s) for s in model.outputs]}


def config(model: LoadedModel, max_batch: int) -> dict[str, Any]:
    """Triton's model configuration, as far as it describes this model: with max_batch_size > 0 the
    dims leave the batch axis out (perf_analyzer adds it, `-b`)."""
    batched = _batched(model)

    def tensor(spec, optional: bool = False) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": spec.name, "data_type": f"TYPE_{_V2_TYPE[spec.dtype]}",
                                 "dims": _dims(spec.shape[1:] if batched else spec.shape)}
        if optional:
            entry["optional"] = True
        return entry

    return {"name": model.name, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
            "version_policy": {"specific": {"versions": [model.config.version]}},
            "max_batch_size": max_batch if batched else 0,
            "input": [tensor(s, optional=s.name == "valid_lens") for s in model.inputs()],
            "output": [tensor(s) for s in model.outputs],
            "dynamic_batching": {}, "parameters": {"kind": {"string_value": model.kind}}}


# -------------------------------------------------------------------------------------- inference


def parse_path(path: str) -> tuple[str, str | None]:
    """(model, version) of /v2/models/{m}[/versions/{v}]/infer."""
    parts = path.split("/")  # "", "v2", "models", m, ["versions", v,] "infer"
    if len(parts) == 5:
        return unquote(parts[3]), None
    if len(parts) == 7 and parts[4] == "versions":
        return unquote(parts[3]), unquote(parts[5])
    raise ModelNotFound(f"no such route: POST {excerpt(path)}")


def _split(headers: Headers, body: bytes | memoryview) -> int:
    """Where the JSON header ends and the binary tensors begin (Inference-Header-Content-Length)."""
    header_length = headers.get(b"inference-header-content-length")
    if header_length is None:
        return len(body)
    if not header_length.isdigit() or not 0 < int(header_length) <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length must be between 1 and the body's {len(body)} "
                         f"bytes, got {excerpt(header_length.decode('latin-1'))}")
    return int(header_length)


def _int(value: Any, what: str) -> int:
    if value.__class__ is not int or value < 0:
        raise BadRequest(f"{what} must be a non-negative integer, got {json_type(value)}"
                         + (f" {value}" if isinstance(value, int | float) and not isinstance(value, bool) else ""))
    return value


def timeout_s(microseconds: int) -> float | None:
    """Triton's `timeout` request parameter: the request's bound in microseconds, 0 for none (as Triton)."""
    return microseconds / 1e6 if microseconds else None


def _flag(parameters: Any, name: str, default: bool = False) -> bool:
    value = parameters.get(name, default) if isinstance(parameters, dict) else default
    if not isinstance(value, bool):
        raise BadRequest(f"parameter {name} must be true or false, got {json_type(value)}")
    return value


class _Reader:
    """The tensors of one inference request: the binary tail is handed out in the order of the
    inputs that declare a binary_data_size, each size checked against what is left."""

    def __init__(self, binary: memoryview, cost: Cost | None, shm: SharedReads):
        self.binary = binary
        self.offset = 0
        self.cost = cost  # where what a tensor's cast or copy will hold is counted, before it is made
        self.shm = shm

    def take(self, size: int, name: str) -> memoryview:
        if size > len(self.binary) - self.offset:
            raise BadRequest(f"input {name}: binary_data_size is {size} bytes, but only "
                             f"{len(self.binary) - self.offset} bytes of binary data are left in the body")
        chunk = self.binary[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def done(self) -> None:
        if self.offset != len(self.binary):
            raise BadRequest(f"the body has {len(self.binary) - self.offset} bytes of binary data that no input's "
                             "binary_data_size accounts for")


class SharedReads:
    """The shared memory one request's inputs read (service.core.shm): the regions, and what a decode on the
    event loop may still read of them (None: on a thread, no bound)."""

    __slots__ = ("regions", "left")

    def __init__(self, regions: Regions | None, inline_bytes: int, loop_thread: int | None):
        self.regions = regions
        self.left = inline_bytes if threading.get_ident() == loop_thread else None

    def of(self, what: str, region: Any) -> Regions:
        if self.regions is None:
            raise SharedMemoryOff(f"{what} names shared memory region {_shown(region)}, but system shared memory is "
                                  "off (ATTEND_SHARED_MEMORY)")
        if not isinstance(region, str):
            raise BadRequest(f"{what}: shared_memory_region must be a string, got {json_type(region)}")
        if self.left is not None and not self.regions.parsed():  # another worker changed them: read on a thread
            raise Offload
        return self.regions

    def tensor(self, region: Any, size: Any, offset: Any, name: str, shape: list[int], datatype: str,
               dtype: np.dtype, cost: Cost | None) -> np.ndarray:
        """Input `name` read from its region: `size` bytes at `offset`, a copy of them (held in `cost`)."""
        regions = self.of(f"input {name}", region)
        size = _int(size, f"input {name}: shared_memory_byte_size")
        offset = _int(offset, f"input {name}: shared_memory_offset")
        count = math.prod(shape)
        if size != count * dtype.itemsize:
            raise BadRequest(f"input {name}: shared_memory_byte_size is {size} bytes, but shape {shape} of {datatype} "
                             f"takes {count * dtype.itemsize}")
        if self.left is not None:
            if size > self.left:
                raise Offload
            self.left -= size
        if cost is not None:
            cost.add(binary_decode(count, dtype.itemsize, dtype.kind == "f", True), f"input {name}")
        return regions.read(region, size, offset, dtype, f"input {name}").reshape(shape)

    def target(self, region: Any, size: Any, offset: Any, name: str, request: Request) -> OutputRegion:
        """Where output `name` of `request` goes (checked now, written after the run)."""
        regions = self.of(f"output {name}", region)
        size = _int(size, f"output {name}: shared_memory_byte_size")
        offset = _int(offset, f"output {name}: shared_memory_offset")
        return regions.target(region, size, offset, 4 * math.prod(output_shape(request, name)), f"output {name}")


def output_shape(request: Request, name: str) -> list[int]:
    """The shape output `name` of `request` will have, from its inputs' shapes."""
    model = request.model
    axes = {axis: request.feed[n].shape[i] for n, i, axis in SizePlan.of(model).reads}
    spec = next(s for s in model.outputs if s.name == name)
    return [d if d.__class__ is int else axes[d] for d in spec.shape]


def _shown(value: Any) -> str:
    return excerpt(value) if isinstance(value, str) else json_type(value)


# What every transport of the protocol checks of an input tensor, in this order (HTTP's JSON and binary
# tensors here, gRPC's typed contents and raw_input_contents in service.grpc.codec): its name, its shape,
# its datatype, then its data.


def input_named(name: Any, model: LoadedModel, seen: set[str]) -> str:
    """`name` of an input of `model` not given before (it joins `seen`), or BadRequest naming the inputs."""
    if not isinstance(name, str):
        raise BadRequest(f"an input's name must be a string, got {json_type(name)}")
    names = [s.name for s in model.inputs()]
    if name not in names:
        raise BadRequest(f"model {model.name} has no input {excerpt(name)}; its inputs: {', '.join(names)}")
    if name in seen:
        raise BadRequest(f"input {name} is given twice")
    seen.add(name)
    return name


def input_shape(shape: Any, name: str) -> list[int]:
    """The input's shape: a list of at most MAX_DIMS non-negative sizes."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise BadRequest(f"input {name}: shape must be a list of at most {MAX_DIMS} sizes, got {json_type(shape)}")
    return [_int(s, f"input {name}: every size of shape") for s in shape]


def input_dtype(datatype: Any, name: str, model: LoadedModel) -> np.dtype:
    """The NumPy dtype of the input's data as sent: one the model's input accepts (converted to its own)."""
    spec = next(s for s in model.inputs() if s.name == name)
    accepted = _ACCEPTED[spec.dtype]
    if not isinstance(datatype, str) or datatype not in accepted:  # (a list or an object is not hashable)
        shown = excerpt(datatype) if isinstance(datatype, str) else json_type(datatype)
        raise BadRequest(f"input {name}: datatype {shown} is not accepted; send {' or '.join(accepted)}")
    return accepted[datatype]


def binary_tensor(chunk: bytes | memoryview, name: str, shape: list[int], datatype: str, dtype: np.dtype,
                  cost: Cost | None, what: str = "binary_data_size") -> np.ndarray:
    """A tensor read in place from raw little-endian bytes (`what`: where they came from, for the error);
    its aligned copy or cast held in `cost` before it is made."""
    count = math.prod(shape)
    if len(chunk) != count * dtype.itemsize:
        raise BadRequest(f"input {name}: {what} is {len(chunk)} bytes, but shape {shape} of {datatype} takes "
                         f"{count * dtype.itemsize}")
    array = np.frombuffer(chunk, dtype=dtype).reshape(shape)
    misaligned = bool(array.ctypes.data % dtype.itemsize)
    if cost is not None:
        cost.add(binary_decode(count, dtype.itemsize, dtype.kind == "f", misaligned), f"input {name}")
    if misaligned:  # wherever the JSON header ended: ONNX Runtime wants it aligned
        array = array.copy()
    return array


def _tensor(entry: Any, model: LoadedModel, reader: _Reader, seen: set[str]) -> tuple[str, np.ndarray]:
    if not isinstance(entry, dict):
        raise BadRequest(f"every item of inputs must be an object, got {json_type(entry)}")
    name = input_named(entry.get("name"), model, seen)
    shape = input_shape(entry.get("shape"), name)
    datatype = entry.get("datatype")
    dtype = input_dtype(datatype, name, model)
    count = math.prod(shape)
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest(f"input {name}: parameters must be an object")
    if "shared_memory_region" in parameters:
        if "data" in entry or "binary_data_size" in parameters:
            raise BadRequest(f"input {name} has data and a shared_memory_region: send one")
        if "shared_memory_byte_size" not in parameters:
            raise BadRequest(f"input {name}: shared_memory_region needs shared_memory_byte_size")
        return name, reader.shm.tensor(parameters["shared_memory_region"], parameters["shared_memory_byte_size"],
                                       parameters.get("shared_memory_offset", 0), name, shape, datatype, dtype,
                                       reader.cost)
    if "binary_data_size" in parameters:
        size = _int(parameters["binary_data_size"], f"input {name}: binary_data_size")
        if size != count * dtype.itemsize:
            raise BadRequest(f"input {name}: binary_data_size is {size} bytes, but shape {shape} of {datatype} "
                             f"takes {count * dtype.itemsize}")
        return name, binary_tensor(reader.take(size, name), name, shape, datatype, dtype, reader.cost)
    if "data" not in entry:
        raise BadRequest(f"input {name} has neither data nor a binary_data_size parameter")
    return name, _json_data(entry["data"], name, shape, dtype, count)


# Besides the tensors' data, a request's values are a few: parameters, shapes, outputs. simdjson makes a
# container Python objects holding the GIL (2 M parameters: 1.2 s of the event loop, on a decode thread) and
# finds a key by reading the keys before it (the keys of an input of 40 k: 5.4 s), so a container of more than
# SMALL values in all is refused before either.
SMALL = 64
_CONTAINERS = (simdjson.Array, simdjson.Object, list, dict)
_ARRAYS = (simdjson.Array, list)


def _small(value: Any, what: str, of: str = "") -> Any:
    """`value` as Python objects, where it holds at most SMALL values in all; else a 400 naming `of` + `what`."""
    if not isinstance(value, _CONTAINERS):
        return value
    left = [SMALL]
    plain = _plain(value, left)
    if left[0] < 0:
        raise BadRequest(f"{of}{what} holds more than {SMALL} values (a request's parameters, shapes and outputs "
                         "hold a few)")
    return plain


def _plain(node: Any, left: list[int]) -> Any:
    """`_small`'s walk; `left`: the values it may still take (below 0: it stopped)."""
    left[0] -= len(node)
    if left[0] < 0:
        return None
    if isinstance(node, _ARRAYS):
        items = list(node)  # an array's containers stay proxies, counted before they are made lists
        for i, item in enumerate(items):
            if isinstance(item, _CONTAINERS):
                items[i] = _plain(item, left)
        return items
    plain = {key: node[key] for key in node}
    for key, item in plain.items():
        if isinstance(item, _CONTAINERS):
            plain[key] = _plain(item, left)
    return plain


def _json_data(data: Any, name: str, shape: list[int], dtype: np.dtype, count: int) -> np.ndarray:
    """`data`, flat or nested in row-major order, as an array of `shape`."""
    integer = dtype.kind == "i"
    if isinstance(data, simdjson.Array):
        flat = _numbers(data, name, integer)
    elif data.__class__ is np.ndarray:  # read by a decode process (read_head)
        flat = data
    elif isinstance(data, list):  # from the slower parser (integers beyond 64 bits)
        flat = np.array(data, dtype=object).ravel()
        if not all(type(x) is int or (type(x) is float and not integer) for x in flat):
            raise BadRequest(f"input {name}: data must hold only {'integers' if integer else 'numbers'}")
        flat = flat.astype(np.float64)
    else:  # (or the error a decode process met reading it)
        raise BadRequest(f"input {name}: data must be an array, got {json_type(given(data))}")
    if flat.size != count:
        raise BadRequest(f"input {name}: data holds {flat.size} values, shape {shape} takes {count}")
    return flat.reshape(shape)


def _numbers(data: simdjson.Array, name: str, integer: bool, float32: bool = False) -> np.ndarray:
    """An input's data, flat: int64, or float64 (`float32`: cast as the service casts every float input,
    service.core.request; beyond float32's range, inf, refused there)."""
    try:
        if integer:
            return np.frombuffer(data.as_buffer(of_type="i"), dtype=np.int64)
        flat = np.frombuffer(data.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        kind = "integers" if integer else "numbers"
        raise BadRequest(f"input {name}: data must hold only {kind} (nested or flat)") from None
    return flat.astype(np.float32) if float32 else flat


def _entry(entry: Any) -> Any:
    """An input's fields as plain values but its data, where it is an object (else as it is: _tensor refuses it)."""
    if not isinstance(entry, simdjson.Object | dict):
        return given(entry)  # (or the error a decode process met reading it)
    if len(entry) > SMALL:
        raise BadRequest(f"an input has {len(entry)} fields; it takes name, datatype, shape, parameters and data")
    # By key: simdjson's items() would make the data a Python list too (a float object a number).
    return {k: entry[k] if k == "data" else _small(entry[k], k, "an input's ") for k in entry}


def _head(text: Any, parser: simdjson.Parser | None = None) -> Any:
    """The inference request's JSON object (simdjson's proxy; orjson's dict where simdjson cannot read it)."""
    try:
        head = (parser or simdjson.Parser()).parse(text)
    except (ValueError, RuntimeError, UnicodeDecodeError) as e:
        if len(text) > PRECISE_BODY_BYTES:  # the slow way holds every number as a Python object
            raise BadRequest(large_not_json(e).message.replace("request body", "inference request")) from None
        try:
            head = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"the inference request is not valid JSON: {e.msg} (line {e.lineno} column "
                             f"{e.colno})") from None
    if not isinstance(head, simdjson.Object | dict):
        raise BadRequest(f"the inference request must be a JSON object, got {json_type(head)}")
    return head


def read_head(text: Any, parser: simdjson.Parser) -> dict[str, Any]:
    """A decode process's reader (service.protocols.json_process) of a large head: the four fields decode_for
    reads, as plain values (containers the thread only names empty), each input's data read as numbers by its
    datatype; in place of a value the thread would refuse, the error it would raise (Raised)."""

    def deferred(check: Any, *args: Any) -> Any:
        try:
            return check(*args)
        except ServiceError as e:
            return Raised.of(e)

    head = _head(text, parser)
    inputs = head.get("inputs")
    if isinstance(inputs, simdjson.Array):
        entries = []
        for entry in inputs:
            entry = deferred(_entry, entry)
            if isinstance(entry, dict) and "data" in entry:
                data = entry["data"]
                entry["data"] = stand_in(data) if data.__class__ is not simdjson.Array else \
                    deferred(_numbers, data, entry.get("name"), entry.get("datatype") in _INTEGERS, True)
            entries.append(stand_in(entry))
            if not isinstance(entry, dict):  # refused, whatever the model: the thread goes no further
                break
        inputs = entries
    return {"id": stand_in(head.get("id")), "parameters": deferred(_small, head.get("parameters"),
            "parameters"), "inputs": stand_in(inputs), "outputs": deferred(_small, head.get("outputs"),
            "outputs")}


def requested(outputs: Any, model: LoadedModel, all_binary: bool) -> list[tuple[str, bool]]:
    """(output name, as binary) for each output to return, in the order asked."""
    names = [s.name for s in model.outputs]
    if outputs is None:
        return [(n, all_binary) for n in names]
    if not isinstance(outputs, list):
        raise BadRequest(f"outputs must be a list, got {json_type(outputs)}")
    wanted: list[tuple[str, bool]] = []
    for entry in outputs:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in names:
            shown = excerpt(name) if isinstance(name, str) else json_type(name)
            raise BadRequest(f"model {model.name} has no output {shown}; its outputs: {', '.join(names)}")
        if any(name == w for w, _ in wanted):
            raise BadRequest(f"output {name} is asked for twice")
        wanted.append((name, _flag(entry.get("parameters"), "binary_data", all_binary)))
    return wanted


def tensors_request(model: LoadedModel, tensors: dict[str, np.ndarray], outputs: list[str], limits: RequestLimits
                    ) -> Request:
    """The request from the protocol's input tensors (valid_lens among them, or absent), with the
    attention weights computed only where `outputs` asks for them: every input there, /attend's checks
    (service.core.request.build_request), their errors naming the input."""
    missing = [s.name for s in model.inputs() if s.name not in tensors and s.name != "valid_lens"]
    if missing:
        raise BadRequest(f"model {model.name} needs input(s) {', '.join(missing)}")
    lens = tensors.pop("valid_lens", None)
    try:
        return build_request(model, tensors, lens, "attention_weights" in outputs, limits)
    except ServiceError as e:  # /attend's checks, said the protocol's way: which input
        if e.field in model.input_names and not e.message.startswith("input "):
            e.message = f"input {e.field}: {e.message}"
        raise


def _encoder(model: LoadedModel, wanted: list[tuple[str, bool]], request_id: str | None,
             targets: dict[str, OutputRegion]) -> Encoder:
    def encode(model: LoadedModel, outputs: dict[str, np.ndarray], return_weights: bool) -> Answer | ServiceError:
        entries, blobs, numbers = [], [], 0
        for name, binary in wanted:
            array = outputs[name]
            entry: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
            target = targets.get(name)
            if target is not None:
                # In its region. Its entry has no parameters: Triton's C++ client reads any as a binary output's.
                error = target.write(array)
                if error is not None:
                    return error
            elif binary:
                blob = np.ascontiguousarray(array, dtype="<f4")
                entry["parameters"] = {"binary_data_size": blob.nbytes}
                blobs.append(memoryview(blob).cast("B"))
            else:
                entry["data"] = array.ravel()
                numbers += array.size
            entries.append(entry)
        head: dict[str, Any] = {"model_name": model.name, "model_version": model.version_text}
        if request_id is not None:
            head["id"] = request_id
        head["outputs"] = entries
        text = json_parts(head, numbers)  # a large JSON tensor: in parts
        # With the model that answered (the batch's snapshot): its X-Model-Version header.
        if not blobs:
            return Answer(text, model.version_headers, JSON, model)
        # In parts: the server sends them in one write without joining them (send_body).
        texts = text if text.__class__ is list else [text]
        return Answer([*texts, *blobs], [(b"inference-header-content-length", b"%d" % sum(map(len, texts))),
                                         *model.version_headers], OCTETS, model)

    return encode


class InferCodec:
    """POST /v2/models/{m}[/versions/{v}]/infer: JSON tensors or binary ones in, as asked out; errors
    in the protocol's `{"error": "<message>"}`."""


    def expected(self, headers: Headers, length: int) -> int:
        header_length = headers.get(b"inference-header-content-length")
        split = int(header_length) if header_length is not None and header_length.isdigit() else length
        return json_decode(min(split, length), 0, 0)

    def aligned_at(self, headers: Headers) -> int:
        # The binary tensors start after the JSON header: read in place where they are aligned.
        length = headers.get(b"inference-header-content-length")
        return int(length) if length is not None and length.isdigit() else 0

    def check_media_type(self, headers: Headers) -> None:
        # tritonclient's sync client sends no Content-Type at all; its aio client application/octet-stream.
        media = media_type(headers)
        if media not in (None, "", "application/json", "application/octet-stream") and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json or application/octet-stream, "
                                       f"got {media[:100]}")

    def decode(self, core: Any, target: Target, headers: Headers, body: bytes | memoryview, cost: Cost
               ) -> tuple[Request, Encoder]:
        model = find_model(core.registry, *target)
        try:
            split = _split(headers, body)
            commas, brackets = json_counts(body[:split])
            # A large head is read in a decode process (service.protocols.json_process), from a copy of it.
            processes = getattr(core, "json_processes", None) if split > PRECISE_BODY_BYTES else None
            cost.decoding(json_decode(split, commas, brackets) + (split if processes else 0))  # binary: _tensor
            shm = SharedReads(core.regions, core.inline_decode_bytes, core.loop_thread)
            return self.decode_for(model, headers, body, core.limits, cost, split, shm, processes)
        except ServiceError as e:
            e.model = model.name
            raise

    def decode_for(self, model: LoadedModel, headers: Headers, body: bytes | memoryview, limits: RequestLimits,
                   cost: Cost | None = None, split: int | None = None, shm: SharedReads | None = None,
                   processes: Any = None) -> tuple[Request, Encoder]:
        """The request for `model` (resolved already) from the body; its binary tensors' casts and copies
        counted in `cost`. `split`: where its JSON header ends, where the caller knows it already. `shm`:
        the shared memory it may name (none: system shared memory is off). `processes`: the JsonProcesses
        that read its head (none: read here)."""
        if split is None:
            split = _split(headers, body)
        text = body[:split] if split < len(body) else body
        head = None if processes is None else processes.parse(text, read_head, getattr(on_thread, "until", None))
        if head is None:  # (or the process, or its reader, failed)
            head = _head(text)
        request_id = head.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise BadRequest(f"id must be a string, got {json_type(request_id)}")
        parameters = _small(given(head.get("parameters")), "parameters")
        inputs = head.get("inputs")
        if not isinstance(inputs, simdjson.Array | list):
            raise BadRequest(f"inputs must be a list of tensors, got {json_type(inputs)}")
        shm = shm or SharedReads(None, 0, None)
        reader, seen, tensors = _Reader(memoryview(body)[split:], cost, shm), set(), {}
        for entry in inputs:
            name, array = _tensor(_entry(entry), model, reader, seen)  # all but the data as plain values
            tensors[name] = array
        reader.done()
        outputs = _small(given(head.get("outputs")), "outputs")
        wanted = requested(outputs, model, _flag(parameters, "binary_data_output"))
        request = tensors_request(model, tensors, [n for n, _ in wanted], limits)
        if isinstance(parameters, dict) and "timeout" in parameters:
            request.timeout_s = timeout_s(_int(parameters["timeout"], "parameter timeout"))
        if split < len(body):
            request.held = len(body)  # binary tensors read in place: the body lives as long as they do
        targets = {}
        for entry in outputs or ():  # checked by `requested`: objects, each a name of the model's
            asked = entry.get("parameters")
            if isinstance(asked, dict) and "shared_memory_region" in asked:
                name = entry["name"]
                if "shared_memory_byte_size" not in asked:
                    raise BadRequest(f"output {name}: shared_memory_region needs shared_memory_byte_size")
                targets[name] = shm.target(asked["shared_memory_region"], asked["shared_memory_byte_size"],
                                           asked.get("shared_memory_offset", 0), name, request)
        request.text_answer = any(not binary and name not in targets for name, binary in wanted)
        return request, _encoder(model, wanted, request_id, targets)

    def error_body(self, error: ServiceError) -> bytes:
        return error_json(error)
