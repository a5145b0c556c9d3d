"""The figures of docs/reliability.md's "Hostile clients and overload": each attack of
tests/service/test_overload.py against a fresh `python -m service` (default settings unless named),
measured and printed as a table. The tests assert the bounds; this prints what was measured.

    python tests/load/hostile.py [--skip-burst] [--tree PATH] [--out docs/reliability.md]

`--tree` serves another checkout's service (e.g. `git worktree add /tmp/base <commit>`): the same attacks on
the tree before a change.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grpc_load import METHOD  # noqa: E402
from pools import grpc_raw, v2_binary  # noqa: E402

from tests.load.report import write_section  # noqa: E402
from tests.server import free_port, running_service  # noqa: E402
from tests.service.test_overload import (  # noqa: E402
    TOY,
    connect,
    queue_of_large_requests,
    read_response,
    requests_counted,
    rss_mb,
    sampling_rss,
    vanishing_clients,
    with_deadline_of_2s,
)

ROWS: list[tuple[str, str, str]] = []
# The budget deploy/kubernetes/attend.yaml sets (320 MiB), so that its burst row sizes that Deployment.
K8S_BUDGET_MIB = 320
COMMAND: list[str] | None = None  # --tree's service; None: this checkout's


def row(attack: str, figure: str, value: str) -> None:
    ROWS.append((attack, figure, value))
    print(f"  {attack}: {figure} = {value}", file=sys.stderr)


def timed(method: str, url: str, body: bytes | None = None) -> tuple[int, float]:
    start = time.monotonic()
    r = httpx.request(method, url, content=body, timeout=30, headers={"content-type": "application/json"})
    return r.status_code, 1e3 * (time.monotonic() - start)


def connections(repository: Path) -> None:
    attack = "1000 connections: 700 idle, 300 with a header begun (`ATTEND_HEADER_TIMEOUT_S=3`)"
    with running_service(repository, command=COMMAND, ATTEND_HEADER_TIMEOUT_S="3") as (url, _):
        idle = [connect(url) for _ in range(700)]
        slow = [connect(url) for _ in range(300)]
        for s in slow:
            s.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\n")
        for name, method, path, body in (("GET /health/live", "GET", "/health/live", None),
                                         ("GET /health/ready", "GET", "/health/ready", None),
                                         ("POST /attend (toy)", "POST", "/attend", TOY)):
            status, ms = timed(method, f"{url}{path}", body)
            row(attack, f"{name} on a new connection", f"{status} in {ms:.1f} ms")
        time.sleep(3.5)
        got = [read_response(s, timeout=5)[0] for s in slow]
        closed = sum(s.recv(1, socket.MSG_PEEK) == b"" for s in idle)
        row(attack, "after 3.5 s: begun headers answered 408 (JSON) and closed", f"{got.count(408)} of 300")
        row(attack, "after 3.5 s: idle connections closed by the server", f"{closed} of 700")
        for s in idle + slow:
            s.close()


def headers(repository: Path) -> None:
    attack = "20 connections each sending a 50 MiB header"
    with running_service(repository, command=COMMAND) as (url, proc):
        before = rss_mb(proc.pid)
        chunk = b"X-Big: " + b"a" * (1024 * 1024 - 9) + b"\r\n"

        def send(_):
            sock = connect(url)
            try:
                sock.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\n")
                for _ in range(50):
                    sock.sendall(chunk)
            except OSError:
                pass
            status = read_response(sock, timeout=5)[0]
            sock.close()
            return status

        start = time.monotonic()
        with sampling_rss(proc.pid, 0.02) as peak, ThreadPoolExecutor(20) as pool:
            statuses = list(pool.map(send, range(20)))
        took = time.monotonic() - start
        row(attack, "answers", f"{statuses.count(431)} x 431, {statuses.count(0)} reset before the answer was read, "
            f"all in {took:.1f} s")
        row(attack, "resident memory: before / peak", f"{before:.0f} / {max(peak):.0f} MiB (+{max(peak) - before:.0f})")


def burst(repository: Path, budget_mib: int | None) -> None:
    setting = f"`ATTEND_MAX_INFLIGHT_BYTES={budget_mib} MiB`" if budget_mib else "the default budget (1 GiB)"
    attack = f"24 concurrent ~30 MB bodies, {setting}"
    rng = np.random.default_rng(0)
    array = rng.normal(size=(1, 780, 512)).tolist()
    body = json.dumps({"model": "dot_product", "queries": array, "keys": array, "values": array}).encode()
    env = {"ATTEND_MAX_INFLIGHT_BYTES": str(budget_mib * 1024 * 1024)} if budget_mib else {}
    with running_service(repository, command=COMMAND, **env) as (url, proc):
        httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"}, timeout=60)
        time.sleep(3)
        before = rss_mb(proc.pid)

        def send(_):
            try:
                return httpx.post(f"{url}/attend", content=body, headers={"content-type": "application/json"},
                                  timeout=120).status_code
            except httpx.HTTPError:
                return 0

        start = time.monotonic()
        with sampling_rss(proc.pid) as peak, ThreadPoolExecutor(24) as pool:
            statuses = list(pool.map(send, range(24)))
        took = time.monotonic() - start
        time.sleep(30)
        after = rss_mb(proc.pid)
        others = len(statuses) - statuses.count(200) - statuses.count(503)
        row(attack, "answers", f"{statuses.count(200)} x 200, {statuses.count(503)} x 503 + Retry-After, "
            f"{others} other, in {took:.1f} s")
        row(attack, "body size", f"{len(body) / 1e6:.1f} MB")
        row(attack, "resident memory: before / peak / 30 s after",
            f"{before:.0f} / {max(peak):.0f} / {after:.0f} MiB (peak +{max(peak) - before:.0f}, "
            f"after {100 * (after - before) / before:+.0f}%)")


def deadline(repository: Path) -> None:
    attack = "`X-Request-Timeout-Ms: 2000` behind 64 queued 8 MB requests (one core)"
    with queue_of_large_requests(repository) as (url, queue):
        waited_for_queue = time.monotonic() + 15
        while time.monotonic() < waited_for_queue:  # until the queue is there: requests held by the service
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            if next(float(x.split()[-1]) for x in metrics.splitlines()
                    if x.startswith("attend_requests_in_flight")) >= 16:
                break
            time.sleep(0.1)
        status, _, waited = with_deadline_of_2s(url)
        statuses = json.loads(queue.communicate(timeout=300)[0])
    row(attack, "answer", f"{status} after {waited:.2f} s")
    row(attack, "the queue's own requests", f"{statuses.count(200)} of {len(statuses)} x 200")


def vanishing(repository: Path, tmp: Path) -> None:
    attack = "200 clients that send half a body, then disconnect"
    log = tmp / "hostile.log"
    with running_service(repository, command=COMMAND, log_path=log, ATTEND_LOG_LEVEL="info") as (url, _):
        metrics = vanishing_clients(url)
    text = log.read_text()
    row(attack, "attend_requests_total",
        f"499: {requests_counted(metrics, '499'):.0f}, 500: {requests_counted(metrics, '500'):.0f}")
    row(attack, "log", f"{text.count('Traceback')} tracebacks, {text.count(' ERROR ')} ERROR lines, "
        f"{text.count(' 499 ')} access lines with 499")


def _mixed_request(rng: np.random.Generator) -> dict:
    """One of four models, batch 1-8, sequences of 16 to 2048, weights asked for or not, valid lengths of
    either form or none: most within the limits, some over them (413) or of a wrong shape (422)."""
    model = str(rng.choice(["dot_product", "dot_product", "multi_head", "additive", "self_attention"]))
    b, n_q, n_k = int(rng.integers(1, 9)), int(rng.choice([16, 64, 128, 256, 512, 1024, 2048])), \
        int(rng.choice([16, 64, 256, 512, 1024, 2048]))
    d = {"dot_product": int(rng.choice([8, 64, 128])), "additive": 20}.get(model, 100)
    request = {"model": model, "queries": rng.standard_normal((b, n_q, d), dtype=np.float32),
               "return_weights": bool(rng.random() < 0.5)}
    if model == "self_attention":
        n_k = n_q
    else:
        request["keys"] = rng.standard_normal((b, n_k, 2 if model == "additive" else d), dtype=np.float32)
        value_size = 100 if model == "multi_head" else int(rng.choice([1, 16, 64]))
        request["values"] = rng.standard_normal((b, n_k, value_size), dtype=np.float32)
    if rng.random() < 0.5:
        request["valid_lens"] = rng.integers(1, n_k + 1, size=(b,) if rng.random() < 0.5 else (b, n_q))
    return request


# The forms of the mix, a request each in turn: every protocol, text and binary, compressed or not.
FORMS = ("/attend JSON", "/attend JSON, gzip", "OIP JSON", "OIP binary", "gRPC")
JSON = {"content-type": "application/json"}


def _oip_json(request: dict) -> bytes:
    """`request` over the Open Inference Protocol with JSON tensors (bench/pools.py has the binary form)."""
    inputs = [{"name": k, "datatype": "INT64" if v.dtype == np.int64 else "FP32", "shape": list(v.shape),
               "data": v.ravel()} for k, v in request.items() if isinstance(v, np.ndarray)]
    asked = ["outputs", "attention_weights"] if request["return_weights"] else ["outputs"]
    return orjson.dumps({"inputs": inputs, "outputs": [{"name": k} for k in asked]},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def _send(form: str, request: dict, http: httpx.Client, grpc_call: Callable[[bytes], bytes]) -> str:
    """`request` sent in `form`; the answer's status (HTTP's, or gRPC's code)."""
    if form == "gRPC":
        try:
            grpc_call(grpc_raw(request)[1])
            return "OK"
        except grpc.RpcError as e:
            return e.code().name
    if form == "OIP binary":
        path, body, head = v2_binary(request)
        headers = {"content-type": "application/octet-stream", "inference-header-content-length": str(head)}
    elif form == "OIP JSON":
        path, body, headers = f"/v2/models/{request['model']}/infer", _oip_json(request), JSON
    else:
        path, headers = "/attend", JSON
        body = orjson.dumps(request, option=orjson.OPT_SERIALIZE_NUMPY)
        if form.endswith("gzip"):
            body, headers = gzip.compress(body, 1), headers | {"content-encoding": "gzip"}
    return str(http.post(path, content=body, headers=headers).status_code)


def mixed(repository: Path, requests: int = 500, clients: int = 4) -> None:
    attack = (f"{requests} large requests from {clients} clients, four models, the forms below in turn, "
              f"`ATTEND_MAX_INFLIGHT_BYTES={K8S_BUDGET_MIB} MiB`")
    rng, lock, sent = np.random.default_rng(0), threading.Lock(), [0]
    answers: dict[str, dict[str, int]] = {form: {} for form in FORMS}
    grpc_port = free_port()
    with running_service(repository, command=COMMAND, ATTEND_INTRA_OP_THREADS="1", ATTEND_INFERENCE_THREADS="1",
                         ATTEND_GRPC_PORT=str(grpc_port),
                         ATTEND_MAX_INFLIGHT_BYTES=str(K8S_BUDGET_MIB << 20)) as (url, proc):
        time.sleep(1)
        before = rss_mb(proc.pid)

        def client(_) -> None:
            with httpx.Client(base_url=url, timeout=120) as http, grpc.insecure_channel(
                    f"127.0.0.1:{grpc_port}", options=[("grpc.max_send_message_length", 256 << 20),
                                                       ("grpc.max_receive_message_length", 256 << 20)]) as channel:
                call = channel.unary_unary(METHOD)  # bytes in, bytes out
                while True:
                    with lock:  # the requests of one generator, whichever client sends them
                        if sent[0] == requests:
                            return
                        form = FORMS[sent[0] % len(FORMS)]
                        sent[0] += 1
                        request = _mixed_request(rng)
                    status = _send(form, request, http, call)
                    with lock:
                        answers[form][status] = answers[form].get(status, 0) + 1

        start = time.monotonic()
        with sampling_rss(proc.pid) as peak, ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        took = time.monotonic() - start
        time.sleep(30)
        after = rss_mb(proc.pid)
    for form, counts in answers.items():
        row(attack, f"answers, {form}", ", ".join(f"{n} x {s}" for s, n in sorted(counts.items())))
    row(attack, "time", f"{took:.0f} s")
    row(attack, "resident memory: before / peak / 30 s after",
        f"{before:.0f} / {max(peak):.0f} / {after:.0f} MiB (peak +{max(peak) - before:.0f} = "
        f"{(max(peak) - before) / K8S_BUDGET_MIB:.2f} x the budget, after +{after - before:.0f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--skip-burst", action="store_true", help="leave out the 30 MB bursts (~2 minutes)")
    parser.add_argument("--tree", type=Path, help="serve this checkout's service instead of this one's")
    parser.add_argument("--out", type=Path, help="also write the table into this markdown file's hostile section")
    args = parser.parse_args()
    global COMMAND
    if args.tree:
        COMMAND = ["bash", "-c", f"cd {args.tree.resolve()} && exec {sys.executable} -m service"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    import tempfile

    connections(args.repository)
    headers(args.repository)
    if not args.skip_burst:
        burst(args.repository, None)
        burst(args.repository, K8S_BUDGET_MIB)
        mixed(args.repository)
    deadline(args.repository)
    vanishing(args.repository, Path(tempfile.mkdtemp()))
    table = ["| attack | figure | measured |", "| --- | --- | --- |"]
    table += [f"| {attack} | {figure} | {value} |" for attack, figure, value in ROWS]
    print("\n".join(table))
    if args.out:
        write_section(args.out, "hostile", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
