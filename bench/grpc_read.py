"""What reading a ModelInferRequest holds the GIL for, by its size: protobuf's parse of the whole message and
the bytes of its raw_input_contents (what the guard did before), against the guard's read now (the tensors
lifted out as views: service.grpc.guard.MessageCheck.read) and the aligned copy the decode then makes of each
misaligned tensor, on its thread with the GIL free. Then typed contents (fp32_contents, int64_contents): the
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


def message(mib: float) -> bytes:
    """W2's three inputs and its valid lengths, raw, of about `mib` MiB in all."""
    n = max(1, int(mib * 2**20 / 12 / 64))
    request = pb.ModelInferRequest(model_name="dot_product", id="r")
    for name in ("queries", "keys", "values"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, n, 64])
        request.raw_input_contents.append(np.ones((1, n, 64), np.float32).tobytes())
    request.inputs.add(name="valid_lens", datatype="INT64", shape=[1])
    request.raw_input_contents.append(np.array([n], np.int64).tobytes())
    return request.SerializeToString()


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
    check = guard.service_check(1 << 40)
    parse = pb.ModelInferRequest.FromString

    print(f"{cpu()}, numpy {np.__version__}; medians of {args.rounds} rounds\n")
    print("| message MiB | protobuf's parse and raw bytes, GIL held (ms) | the guard's read, GIL held (ms) "
          "| aligned copies, GIL free (ms) |")
    print("| ---: | ---: | ---: | ---: |")
    for mib in (float(m) for m in args.mib.split(",")):
        data = message(mib)
        whole = _ms(lambda: list(parse(data).raw_input_contents), args.rounds)  # noqa: B023
        read = _ms(lambda: check.read("ModelInfer", data, parse), args.rounds)  # noqa: B023
        received, _ = check.read("ModelInfer", data, parse)
        views = received.raw if received.raw is not None else []
        copies = _ms(lambda: [np.frombuffer(v, np.uint8).copy() for v in views], args.rounds)  # noqa: B023
        print(f"| {len(data) / 2**20:.2f} | {whole:.2f} | {read:.3f} | {copies:.2f} |")

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
