"""A large ModelInferRequest is read with its tensors lifted out (service.grpc.guard.MessageCheck.read,
service.grpc.wire.split): the rest is protobuf's own parse, and the tensors are protobuf's bytes, as views of the
message received (no copy), wherever the raw fields lie among the others."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from service.grpc import guard, wire
from service.grpc.proto import grpc_service_pb2 as pb


def _check(limit: int = 1 << 40) -> guard.MessageCheck:
    return guard.service_check(limit)


def _message(rng: np.random.Generator, sizes: list[int]) -> bytes:
    """A request whose raw_input_contents have `sizes`, each serialized in a part of its own among the others'
    (protobuf merges concatenated messages), with outputs, parameters and an id between them."""
    parts = []
    for i, size in enumerate(sizes):
        part = pb.ModelInferRequest()
        part.inputs.add(name=f"in{i}", datatype="FP32", shape=[size // 4])
        if i % 2:
            part.outputs.add(name=f"out{i}").parameters["binary_data"].bool_param = True
        parts.append(part.SerializeToString())
        raw = pb.ModelInferRequest()
        raw.raw_input_contents.append(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        parts.append(raw.SerializeToString())
    tail = pb.ModelInferRequest(model_name="multi_head", model_version="1", id="x" * int(rng.integers(0, 5)))
    tail.parameters["timeout"].int64_param = 5
    order = rng.permutation(len(parts))
    return b"".join(parts[i] for i in order) + tail.SerializeToString()


@pytest.mark.parametrize("sizes", [[70_000], [0, 1 << 20, 3], [127, 128, 16384, 200_000], [65_536] * 5])
@pytest.mark.parametrize("method", ["ModelInfer", "ModelStreamInfer"])
def test_the_split_is_protobufs_parse(sizes, method):
    rng = np.random.default_rng(len(sizes))
    data = _message(rng, sizes)
    assert len(data) > wire.SCAN_BYTES
    check = _check()
    received, size = check.read(method, data, pb.ModelInferRequest.FromString)

    whole = pb.ModelInferRequest.FromString(data)
    assert size == check.parsed_bytes(method, data) >= len(data)  # the packed shapes grow, parsed
    assert [bytes(view) for view in received.raw] == list(whole.raw_input_contents)
    assert all(view.obj is data for view in received.raw)  # views of the message: nothing copied
    whole.ClearField("raw_input_contents")
    assert received.message == whole and received.message.SerializeToString() == whole.SerializeToString()


def test_a_small_message_or_one_without_raw_contents_is_parsed_whole():
    check = _check()
    small = pb.ModelInferRequest(model_name="dot_product", raw_input_contents=[b"\0" * 64]).SerializeToString()
    typed = pb.ModelInferRequest(model_name="dot_product")
    typed.inputs.add(name="queries", datatype="FP32", shape=[20_000]).contents.fp32_contents.extend([1.5] * 20_000)
    for data in (small, typed.SerializeToString()):
        received, size = check.read("ModelInfer", data, pb.ModelInferRequest.FromString)
        assert received.raw is None and size == check.parsed_bytes("ModelInfer", data) >= len(data)
        assert received.message == pb.ModelInferRequest.FromString(data)
    # A control call's message is parsed as it is, not as a Received.
    request, _ = check.read("ModelReady", pb.ModelReadyRequest(name="m").SerializeToString(),
                            pb.ModelReadyRequest.FromString)
    assert request == pb.ModelReadyRequest(name="m")


def test_a_field_that_runs_past_the_message_is_not_a_message():
    data = _message(np.random.default_rng(0), [100_000])
    with pytest.raises(DecodeError):
        _check().read("ModelInfer", data[:-3], pb.ModelInferRequest.FromString)


def test_the_limit_holds_for_the_split():
    data = _message(np.random.default_rng(1), [100_000])
    with pytest.raises(Exception, match="over the limit of 1000 "):
        _check(1000).read("ModelInfer", data, pb.ModelInferRequest.FromString)
