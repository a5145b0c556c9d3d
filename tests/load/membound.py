"""What one request of each form costs in memory: the service's peak resident memory (VmHWM) above its
idle resident memory, its JSON decode process's added (service.protocols.json_process), a fresh `python -m
service` a form, beside what the service counts for it against
ATTEND_MAX_INFLIGHT_BYTES (service.core.cost: the same stages, computed here in-process) and their ratio.
Bodies from tests/load/bodies.py, of about --mib MiB before compression: every form over HTTP, and ModelInfer's
messages over gRPC; the largest attention weights the limits allow as more rows. Default limits, but a budget
large enough that nothing is refused for it.

    python tests/load/membound.py [--mib 24] [--out docs/reliability.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import types
from pathlib import Path

import grpc
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.config import Settings  # noqa: E402
from service.core.batching import Job  # noqa: E402
from service.core.cost import Budget, Cost  # noqa: E402
from service.core.errors import ServiceError  # noqa: E402
from service.core.inflate import Inflater, encoding_of  # noqa: E402
from service.core.runtime import Registry  # noqa: E402
from service.grpc import guard  # noqa: E402
from service.grpc.codec import GrpcCodec  # noqa: E402
from service.grpc.proto import grpc_service_pb2 as pb  # noqa: E402
from service.protocols.attend import AttendCodec  # noqa: E402
from service.protocols.json_process import JsonProcesses  # noqa: E402
from service.protocols.v2 import InferCodec, parse_path  # noqa: E402
from tests.load.bodies import ATTEND, GRPC, Body, every_form, grpc_forms  # noqa: E402
from tests.load.report import write_section  # noqa: E402
from tests.server import free_port, running_service  # noqa: E402


def status_mib(pid: int, field: str) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def idle_mib(pid: int) -> float:
    """MiB resident now, the peak (VmHWM) reset to it (Linux's clear_refs): a request's peak above it, not the
    start's (loading the models), which the service gives back once idle (10 MiB above idle, 2026-12-07)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_mib(pid, "VmRSS")


def resident_after_idle(pid: int, idle: float) -> float:
    """MiB resident above `idle` once the service has given memory back (it does after 2 s without
    requests): the least of 16 samples half a second apart."""
    left = []
    for _ in range(16):
        time.sleep(0.5)
        left.append(status_mib(pid, "VmRSS") - idle)
    return min(left)


def secondary_heaps(pid: int) -> list[str]:
    """glibc's heaps besides the main one in process `pid` (service.core.memory keeps one): each is a 64 MiB
    reservation at a 64 MiB boundary, read-write where used (its first page, the heap's header, resident),
    the rest inaccessible. (Libraries map untouched 64 MiB regions too.)"""
    spans = []  # anonymous mappings: start, end, permissions, resident kB
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append([start, end, fields[1], 0] if len(fields) == 5 else None)
        elif fields[0] == "Rss:" and spans[-1] is not None:
            spans[-1][3] = int(fields[1])
    spans = [s for s in spans if s is not None]
    size = 64 << 20
    heaps = []
    for i, (start, end, perms, resident) in enumerate(spans):
        rest = spans[i + 1] if i + 1 < len(spans) else [end, end, "", 0]
        if start % size == 0 and perms == "rw-p" and resident and (
                end == start + size or (rest[0] == end and rest[1] == start + size and rest[2] == "---p")):
            heaps.append(f"{start:x}-{end:x}")
    return heaps


def largest_weights(elements: int, model: str = "dot_product", sent: bool = True) -> Body:
    """A request with `elements` attention weights (batch x 1024 x 1024), returned or not."""
    n = 1024
    batch = max(1, elements // (n * n))
    rng = np.random.default_rng(0)
    sizes = {"dot_product": (1, 1), "additive": (20, 2)}[model]  # the query and key sizes it takes
    content = json.dumps({"model": model, "queries": rng.normal(size=(batch, n, sizes[0])).round(3).tolist(),
                          "keys": rng.normal(size=(batch, n, sizes[1])).round(3).tolist(),
                          "values": rng.normal(size=(batch, n, 1)).round(3).tolist(), "return_weights": sent}).encode()
    answer = "JSON answer" if sent else "not returned"
    return Body(f"the largest attention weights, {model} ({answer})", ATTEND, content,
                {"content-type": "application/json"})


def decode_processes(pid: int) -> list[int]:
    """The JSON decode processes of the service `pid` (each thread's children: a thread of the app starts them)."""
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"json_process" in Path(f"/proc/{c}/cmdline").read_bytes()]


def counted(body: Body, registry: Registry, settings: Settings, processes: JsonProcesses | None = None
            ) -> tuple[int, str]:
    """The most the service holds for `body` in its budget (as service.http.endpoint and service.core
    count it, stage by stage), and how far it got ("ok", or the error's code)."""
    cost = Cost(Budget(1 << 50))
    headers = {k.encode(): v.encode() for k, v in body.headers.items()}
    # What a decode reads of the dataplane: no shared memory; on a thread (no bound on the shared memory it reads).
    core = types.SimpleNamespace(registry=registry, limits=settings.request_limits(), regions=None,
                                 inline_decode_bytes=settings.inline_decode_bytes, loop_thread=None,
                                 json_processes=processes)
    try:
        if body.path == GRPC:
            return _counted_grpc(body, core, cost, settings)
        content: bytes = body.content
        codec = AttendCodec() if body.path == ATTEND else InferCodec()
        target = (None, None) if body.path == ATTEND else parse_path(body.path)
        encoding = encoding_of(headers.get(b"content-encoding"))
        # Arriving: written into one aligned buffer (the Open Inference Protocol's, uncompressed), or
        # received in pieces and joined; and what its decode will hold at least.
        pieces = 1 if body.path != ATTEND and encoding is None else 2
        expected = codec.expected(headers, len(content)) if encoding is None else 0
        cost.hold(pieces * len(content) + expected)
        if encoding is not None:
            inflater = Inflater(content, encoding, settings.max_body_bytes, settings.max_inflate_ratio, cost,
                                len(content))
            inflater.run()
            content = inflater.body()
        cost.base = len(content)
        if cost.base > settings.inline_decode_bytes:
            cost.hold(cost.base + codec.expected(headers, cost.base))
        request, _ = codec.decode(core, target, headers, content, cost)
        cost.hold(request.held + Job(request, 0.0).cost)
        return cost.peak, "ok"
    except ServiceError as e:
        return cost.peak, e.code


def _counted_grpc(body: Body, core: types.SimpleNamespace, cost: Cost, settings: Settings) -> tuple[int, str]:
    """counted() for a ModelInfer message: read as the guard reads it, held as service.grpc.server holds it."""
    check = guard.service_check(settings.max_body_bytes)
    received, size = check.read(GRPC, body.content, pb.ModelInferRequest.FromString)
    cost.base = size
    cost.hold(size)
    if size > settings.inline_decode_bytes:
        cost.hold(size)  # GrpcCodec.expected: nothing more
    request, _ = GrpcCodec().decode(core, None, {}, received, cost)
    cost.hold(request.held + Job(request, 0.0).cost)
    return cost.peak, "ok"


def _send_grpc(address: str, body: Body) -> int:
    """`body` as a ModelInfer call: the HTTP status of its gRPC status (service.grpc.status's mapping)."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        try:
            channel.unary_unary(f"/inference.GRPCInferenceService/{GRPC}")(body.content, timeout=300)
            return 200
        except grpc.RpcError as e:
            return {grpc.StatusCode.RESOURCE_EXHAUSTED: 413, grpc.StatusCode.INVALID_ARGUMENT: 400,
                    grpc.StatusCode.UNAVAILABLE: 503}.get(e.code(), 500)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=24.0, help="bodies of about this size before compression")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--out", type=Path, help="also write the table into this markdown file's membound section")
    args = parser.parse_args()
    settings = Settings()
    registry = Registry.load(args.repository, "cpu", 1)
    weights = settings.max_weight_elements
    bodies = every_form(int(args.mib * 2**20)) + grpc_forms(int(args.mib * 2**20)) + [
        largest_weights(weights), largest_weights(weights, sent=False), largest_weights(weights, "additive")]
    table = ["| form | on the wire MiB | status | counted MiB | peak - idle MiB | peak / counted |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    print("\n".join(table))
    count = settings.resolved_json_processes()
    processes = JsonProcesses(count) if count else None
    for body in bodies:
        estimate, _ = counted(body, registry, settings, processes)
        port = free_port()
        with running_service(args.repository, ATTEND_LOG_LEVEL="warning", ATTEND_INTRA_OP_THREADS="1",
                             ATTEND_MAX_INFLIGHT_BYTES=str(1 << 40), ATTEND_GRPC_PORT=str(port)) as (url, proc):
            pids = [proc.pid, *decode_processes(proc.pid)]
            idle = [idle_mib(pid) for pid in pids]
            if body.path == GRPC:
                status = _send_grpc(f"127.0.0.1:{port}", body)
            else:
                status = httpx.post(f"{url}{body.path}", content=body.content, headers=body.headers,
                                    timeout=300).status_code
            # Each process's peak above its idle, added: their peaks may not coincide (an upper bound).
            peak = sum(status_mib(pid, "VmHWM") - at_idle for pid, at_idle in zip(pids, idle, strict=True))
        # A ratio of a few MiB says nothing: any request moves the peak by ~2 MiB (the refused rows).
        ratio = f"{peak / (estimate / 2**20):.2f}" if estimate >= 8 * 2**20 else "-"
        table.append(f"| {body.name} | {body.wire / 2**20:.1f} | {status} | {estimate / 2**20:.0f} | "
                     f"{peak:.0f} | {ratio} |")
        print(table[-1], flush=True)
    if processes is not None:
        processes.close()
    if args.out:
        write_section(args.out, "membound", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
