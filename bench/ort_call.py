"""What a call into ONNX Runtime costs the book's toy request (additive, 2 x 1 x 20 queries, 10 keys),
by API: the public `InferenceSession.run`, with RunOptions (what the service calls), IO binding, and
the private C++ session's `run` (what it called before). One core, one ONNX Runtime thread; medians of
5 rounds of 20000 calls.

    python bench/ort_call.py [--repository model_repository]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.core.runtime import Registry  # noqa: E402


def per_call_us(call, calls: int = 20000, rounds: int = 5) -> float:
    for _ in range(calls // 10):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    model = Registry.load(args.repository, "cpu", 1).get("additive")
    rng = np.random.default_rng(0)
    feed = {"queries": rng.normal(size=(2, 1, 20)).astype(np.float32), "keys": np.ones((2, 10, 2), np.float32),
            "values": np.arange(80, dtype=np.float32).reshape(2, 10, 4),
            "valid_lens": np.array([[2], [6]], dtype=np.int64)}
    names = [s.name for s in model.outputs]
    session, options, binding = model.session, ort.RunOptions(), model.session.io_binding()

    def bound():
        for name, value in feed.items():
            binding.bind_cpu_input(name, value)
        for name in names:
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    rows = [("InferenceSession.run", lambda: session.run(names, feed)),
            ("InferenceSession.run with RunOptions (the service)", lambda: session.run(names, feed, options)),
            ("IO binding, outputs copied out", bound),
            ("the private C++ session's run", lambda: session._sess.run(names, feed, None))]
    print("| API | us a call |")
    print("| --- | ---: |")
    for label, call in rows:
        print(f"| {label} | {per_call_us(call):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
