"""A large ModelInferRequest is read with its tensors lifted out (service.grpc.guard.MessageCheck.read,
service.grpc.wire.split): the rest is protobuf's own parse, and the tensors are protobuf's bytes, as views of the
message received (no copy), wherever the raw fields lie among the others; and so are packed fp32_contents and
fp64_contents, the lengths of the messages that held them rewritten."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.grpc import guard, wire
from service.grpc.proto import grpc_service_pb2 as pb
from tests.load.bodies import proto_field


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


def test_a_small_message_or_one_without_raw_or_float_contents_is_parsed_whole():
    check = _check()
    small = pb.ModelInferRequest(model_name="dot_product", raw_input_contents=[b"\0" * 64]).SerializeToString()
    small_typed = pb.ModelInferRequest(model_name="dot_product")
    small_typed.inputs.add(name="queries", datatype="FP32", shape=[9]).contents.fp32_contents.extend([1.5] * 9)
    typed = pb.ModelInferRequest(model_name="dot_product")
    typed.inputs.add(name="valid_lens", datatype="INT64", shape=[70_000]).contents.int64_contents.extend([3] * 70_000)
    for data in (small, small_typed.SerializeToString(), typed.SerializeToString()):
        received, size = check.read("ModelInfer", data, pb.ModelInferRequest.FromString)
        assert received.raw is None and received.typed is None
        assert size == check.parsed_bytes("ModelInfer", data) >= len(data)
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


TENSOR = pb.ModelInferRequest.InferInputTensor
INPUTS = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["inputs"].number
CONTENTS = TENSOR.DESCRIPTOR.fields_by_name["contents"].number
FP32 = pb.InferTensorContents.DESCRIPTOR.fields_by_name["fp32_contents"].number


def _typed_message(rng: np.random.Generator, inputs: int, unpacked: bool = False) -> bytes:
    """A request of `inputs` inputs, each sent in parts (protobuf merges them): packed fp32_contents in one to
    three runs, fp64_contents, int64_contents and parameters among them, a contents field twice; `unpacked`:
    one more fp32 value of the last input as a field of its own."""
    tensors = []
    for i in range(inputs):
        parts = [TENSOR(name=f"in{i}", datatype="FP32", shape=[3, 5]).SerializeToString()]
        for run in range(1 + i % 3):
            contents = pb.InferTensorContents(fp32_contents=rng.standard_normal(int(rng.integers(0, 9000))))
            if run == 1:
                contents.int64_contents.extend([1, 2, 3])
            if run == 2 or i < 2:
                contents.fp64_contents.extend(rng.standard_normal(8200))
            parts.append(proto_field(CONTENTS, contents.SerializeToString()))
        extra = TENSOR()
        extra.parameters["binary_data_size"].int64_param = i
        parts.insert(int(rng.integers(1, len(parts))), extra.SerializeToString())
        if unpacked and i == inputs - 1:
            parts.append(proto_field(CONTENTS, wire.varint(FP32 << 3 | 5) + np.float32(2.5).tobytes()))
        tensors.append(proto_field(INPUTS, b"".join(parts)))
    head = pb.ModelInferRequest(model_name="dot_product", id="i" * int(rng.integers(0, 4))).SerializeToString()
    tail = pb.ModelInferRequest(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="outputs")])
    return head + b"".join(tensors) + tail.SerializeToString()


@pytest.mark.parametrize("inputs", [1, 2, 4])
def test_typed_contents_lifted_are_protobufs_parse(inputs):
    """fp32_contents and fp64_contents come out as the little-endian bytes of the values protobuf parses, in
    their order across runs and merged fields; the rest, with its lengths rewritten, parses as the whole
    message less those fields."""
    rng = np.random.default_rng(inputs)
    data = _typed_message(rng, inputs)
    assert len(data) > wire.SCAN_BYTES
    received, size = _check().read("ModelInfer", data, pb.ModelInferRequest.FromString)

    whole = pb.ModelInferRequest.FromString(data)
    assert size == _check().parsed_bytes("ModelInfer", data) and received.raw is None
    expected = {}
    for i, tensor in enumerate(whole.inputs):
        for field, dtype in (("fp32_contents", "<f4"), ("fp64_contents", "<f8")):
            if getattr(tensor.contents, field):
                expected[i, field] = np.array(getattr(tensor.contents, field), dtype).tobytes()
            tensor.contents.ClearField(field)
    assert {key: b"".join(views) for key, views in received.typed.items()} == expected
    assert all(view.obj is data for views in received.typed.values() for view in views)
    assert received.message == whole and received.message.SerializeToString() == whole.SerializeToString()


def test_typed_contents_also_sent_unpacked_are_parsed_whole():
    data = _typed_message(np.random.default_rng(0), 3, unpacked=True)
    received, _ = _check().read("ModelInfer", data, pb.ModelInferRequest.FromString)
    assert received.typed is None and received.message == pb.ModelInferRequest.FromString(data)
    assert received.message.inputs[2].contents.fp32_contents[-1] == 2.5


@pytest.mark.parametrize("runs", [1, 2])
def test_lifted_typed_contents_are_decoded_in_place_and_their_copies_counted(repository, runs):
    """The decode reads a lifted tensor in place where it is aligned; a misaligned one, or one in several
    runs (joined), is copied, and the copy is counted in the request's cost."""
    from service.core.cost import Budget, Cost
    from service.core.request import RequestLimits
    from service.core.runtime import Registry
    from service.grpc.codec import decode_for

    model = Registry.load(repository, "cpu", 1).get("dot_product")
    x = np.random.default_rng(runs).standard_normal((1, 300, 64)).astype(np.float32)
    for shift in range(4):
        tensors = []
        for name in ("queries", "keys", "values"):
            parts = [TENSOR(name=name, datatype="FP32", shape=x.shape).SerializeToString()]
            for run in np.array_split(x.ravel(), runs):
                parts.append(proto_field(CONTENTS, pb.InferTensorContents(fp32_contents=run).SerializeToString()))
            tensors.append(proto_field(INPUTS, b"".join(parts)))
        head = pb.ModelInferRequest(model_name="dot_product", id="i" * shift).SerializeToString()
        received, _ = _check().read("ModelInfer", head + b"".join(tensors), pb.ModelInferRequest.FromString)
        cost = Cost(Budget(1 << 30))
        request, _ = decode_for(model, received.message, RequestLimits(), cost, typed=received.typed)
        copied = 0
        for name, parts in zip(("queries", "keys", "values"), received.typed.values(), strict=True):
            np.testing.assert_array_equal(request.feed[name], x)
            in_place = np.shares_memory(request.feed[name], np.frombuffer(parts[0], np.uint8))
            assert in_place == (runs == 1 and _aligned(parts[0])), (name, shift)
            copied += 0 if in_place else x.nbytes
        assert cost.held >= copied + 3 * x.size, (cost.held, copied, shift)  # and the finiteness check's mask


def _aligned(view: memoryview) -> bool:
    return np.frombuffer(view, np.uint8).ctypes.data % 4 == 0


_PIECES = st.lists(st.tuples(
    st.sampled_from(["fp32", "fp64", "int64", "name", "parameter", "contents"]),
    st.integers(0, 3000)), min_size=0, max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=st.lists(_PIECES, min_size=1, max_size=4), raw=st.integers(0, 2), head=st.integers(0, 3),
       unpacked=st.booleans())
def test_any_split_is_protobufs_parse(inputs, raw, head, unpacked):
    """Inputs of random pieces in random order (packed runs of fp32_contents and fp64_contents, int64_contents,
    names, parameters, empty contents; merged by protobuf as concatenated), raw contents among them, a
    message of any size: the split is protobuf's parse, whatever it lifts."""
    rng = np.random.default_rng(len(inputs) * 7 + raw)
    parts = [pb.ModelInferRequest(model_name="dot_product", id="i" * head).SerializeToString()]
    for pieces in inputs:
        tensor = []
        for kind, size in pieces:
            contents = pb.InferTensorContents()
            if kind == "fp32":
                contents.fp32_contents.extend(rng.standard_normal(size))
            elif kind == "fp64":
                contents.fp64_contents.extend(rng.standard_normal(size))
            elif kind == "int64":
                contents.int64_contents.extend(rng.integers(-1000, 1000, size % 50))
            elif kind == "name":
                tensor.append(TENSOR(name="x" * (size % 9), shape=[size]).SerializeToString())
                continue
            elif kind == "parameter":
                extra = TENSOR()
                extra.parameters[f"p{size}"].int64_param = size
                tensor.append(extra.SerializeToString())
                continue
            tensor.append(proto_field(CONTENTS, contents.SerializeToString()))
        if unpacked and pieces:
            tensor.append(proto_field(CONTENTS, wire.varint(FP32 << 3 | 5) + np.float32(0.5).tobytes()))
        parts.append(proto_field(INPUTS, b"".join(tensor)))
        for _ in range(raw):
            parts.append(pb.ModelInferRequest(raw_input_contents=[rng.bytes(int(rng.integers(0, 40_000)))])
                         .SerializeToString())
    data = b"".join(parts)
    received, _ = _check().read("ModelInfer", data, pb.ModelInferRequest.FromString)

    whole = pb.ModelInferRequest.FromString(data)
    raw_views = received.raw or []
    assert [bytes(v) for v in raw_views] == (list(whole.raw_input_contents) if received.raw is not None else [])
    if received.raw is not None:
        whole.ClearField("raw_input_contents")
    for (i, field), views in (received.typed or {}).items():
        dtype = "<f4" if field == "fp32_contents" else "<f8"
        assert b"".join(views) == np.array(getattr(whole.inputs[i].contents, field), dtype).tobytes()
        whole.inputs[i].contents.ClearField(field)
    assert received.message == whole
    assert received.message.SerializeToString() == whole.SerializeToString()
    if len(data) <= wire.SCAN_BYTES or (unpacked and any(inputs)):
        assert received.typed is None
