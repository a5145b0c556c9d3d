"""A ModelInfer answer is serialized where it is encoded (service.grpc.codec.serialized), not by grpc on the event
loop: its bytes are protobuf's own, for ModelInfer and for ModelStreamInfer, whatever the outputs' sizes."""

from __future__ import annotations

import numpy as np
import pytest

from service.grpc.codec import serialized
from service.grpc.guard import _serialize
from service.grpc.proto import grpc_service_pb2 as pb

# Raw outputs whose lengths cross the varint's byte boundaries, an empty one (an output in shared memory), a large one.
SIZES = [[0], [127], [128], [16383, 16384], [5, 0, 2_097_152], [300, 1 << 21, 0, 7]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("stream", [False, True])
def test_the_bytes_are_protobufs_own(sizes, stream):
    rng = np.random.default_rng(len(sizes))
    raw = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    response = pb.ModelInferResponse(model_name="multi_head", model_version="3", id="a-request")
    for i, size in enumerate(sizes):
        response.outputs.add(name=f"out{i}", datatype="FP32", shape=[1, size])
    whole = pb.ModelInferResponse()
    whole.CopyFrom(response)
    whole.raw_output_contents.extend(raw)
    expected = pb.ModelStreamInferResponse(infer_response=whole) if stream else whole

    wire = serialized(response, raw, stream)
    assert _serialize(wire) == expected.SerializeToString()
    assert type(expected).FromString(wire.SerializeToString()) == expected
    assert _serialize(expected) == expected.SerializeToString()  # a message (errors, control calls) as before
