"""What reading a ModelInferRequest holds the GIL for, by its size and the form of its tensors (raw_input_contents,
or typed fp32_contents): protobuf's parse of the whole message and the tensors' bytes or arrays out of it (what
the guard and the decode did before), against the guard's read now (the tensors lifted out as views:
service.grpc.guard.MessageCheck.read) and the aligned copy the decode then makes of each misaligned tensor, on
its thread with the GIL free. Then typed contents parsed (a message under 64 KiB, or int64_contents): the
decode's copy of a tensor out of the parsed message (np.array), against np.fromiter (before 2026-12-07).
Medians over rounds, in process, on one core.

    python bench/grpc_read.py [--mib 0.25,1,8,24] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compute import cpu  # noqa: E402

from service.grpc import guard  # noqa: E402
from service.grpc.proto import grpc_service_pb2 as pb  # noqa: E402

CHECK = guard.service_check(1 << 40)


def message(mib: float, form: str = "raw") -> bytes:
    """W2's three inputs and its valid lengths, raw or typed, of about `mib` MiB in all."""
    n = max(1, int(mib * 2**20 / 12 / 64))
    request = pb.ModelInferRequest(model_name="dot_product", id="r")
    for name in ("queries", "keys", "values"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, n, 64])
        if form == "raw":
            request.raw_input_contents.append(np.ones((1, n, 64), np.float32).tobytes())
        else:
            tensor.contents.fp32_contents.extend(np.ones(n * 64, np.float32))
    tensor = request.inputs.add(name="valid_lens", datatype="INT64", shape=[1])
    if form == "raw":
        request.raw_input_contents.append(np.array([n], np.int64).tobytes())
    else:
        tensor.contents.int64_contents.append(n)
    return request.SerializeToString()


def old_read(data: bytes, form: str) -> list:
    """The old read: the walk that bounds the parse, the whole parse, then the tensors' bytes (raw) or arrays
    (typed: the decode's np.array)."""
    CHECK.parsed_bytes("ModelInfer", data)
    parsed = pb.ModelInferRequest.FromString(data)
    if form == "raw":
        return list(parsed.raw_input_contents)
    return [np.array(t.contents.fp32_contents, np.float32) for t in parsed.inputs[:3]]


def _ms(work, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="0.25,1,8,24", help="message sizes, MiB")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    parse = pb.ModelInferRequest.FromString

    print(f"{cpu()}, numpy {np.__version__}; medians of {args.rounds} rounds\n")
    print("| tensors | message MiB | protobuf's parse and the tensors out of it, GIL held (ms) "
          "| the guard's read, GIL held (ms) | aligned copies, GIL free (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for form in ("raw", "typed"):
        for mib in (float(m) for m in args.mib.split(",")):
            data = message(mib, form)
            whole = _ms(lambda: old_read(data, form), args.rounds)  # noqa: B023
            read = _ms(lambda: CHECK.read("ModelInfer", data, parse), args.rounds)  # noqa: B023
            received, _ = CHECK.read("ModelInfer", data, parse)
            views = received.raw or [v for parts in (received.typed or {}).values() for v in parts]
            copies = _ms(lambda: [np.frombuffer(v, np.uint8).copy() for v in views], args.rounds)  # noqa: B023
            print(f"| {form} | {len(data) / 2**20:.2f} | {whole:.2f} | {read:.3f} | {copies:.2f} |")

    print("\n| typed contents, 2 M values | np.fromiter (ms) | np.array (ms) |")
    print("| --- | ---: | ---: |")
    contents = pb.InferTensorContents()
    contents.fp32_contents.extend(np.ones(2**21, np.float32))
    contents.int64_contents.extend(np.arange(2**21))
    for field, dtype in (("fp32_contents", np.float32), ("int64_contents", np.int64)):
        values = getattr(contents, field)
        before = _ms(lambda: np.fromiter(values, dtype=dtype, count=len(values)), args.rounds)  # noqa: B023
        now = _ms(lambda: np.array(values, dtype=dtype), args.rounds)  # noqa: B023
        print(f"| {field} | {before:.1f} | {now:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
