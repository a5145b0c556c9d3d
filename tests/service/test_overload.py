"""Hostile clients and overload against the real process (`python -m service`, the default settings
unless a test says otherwise): idle and dripping connections, huge headers, bodies that never end,
more body bytes than the budget, deadlines behind large decodes, clients that vanish. Health
probes and a normal request on a new connection keep being answered; every refusal is the one JSON
error body; memory stays bounded and comes back."""

import contextlib
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from service.http.schemas import toy_request
from tests.server import AHEAD, running_service

pytestmark = pytest.mark.slow

TOY = json.dumps(toy_request()).encode()


@pytest.fixture(scope="module", autouse=True)
def enough_file_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def sampling_rss(pid: int, every_s: float = 0.05):
    """The process's resident MiB, sampled in a thread while the block runs: the list of samples."""
    samples = [rss_mb(pid)]
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append(rss_mb(pid))
            time.sleep(every_s)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield samples
    finally:
        done.set()
        sampler.join()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def answered_within(url: str, seconds: float) -> dict:
    """/health/live, /health/ready and a normal POST /attend, each on a new connection: their times."""
    times = {}
    for name, method, path, body in (("live", "GET", "/health/live", None), ("ready", "GET", "/health/ready", None),
                                     ("attend", "POST", "/attend", TOY)):
        start = time.monotonic()
        response = httpx.request(method, f"{url}{path}", content=body, timeout=seconds,
                                 headers={"content-type": "application/json"})
        times[name] = time.monotonic() - start
        assert response.status_code == 200, (name, response.status_code, response.text)
    return times


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server answered and closed before taking all of it


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, dict, bytes]:
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    if b"\r\n\r\n" not in data:
        return 0, {}, data
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    try:
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except OSError:
        pass
    return int(lines[0].split()[1]), headers, body


def test_a_thousand_idle_and_slow_connections_leave_health_and_requests_answered(repository):
    with running_service(repository, ATTEND_HEADER_TIMEOUT_S="3") as (url, _):
        idle = [connect(url) for _ in range(700)]
        slow = [connect(url) for _ in range(300)]
        for s in slow:
            s.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\n")  # a header begun, never finished
        times = answered_within(url, 1.0)
        assert max(times.values()) < 1.0, times
        for s in slow[:100]:
            s.sendall(b"X-Drip: 1\r\n")  # a byte now and then does not buy time
        # Past the header timeout: connections that began a request get a 408 with the JSON body,
        # idle ones are closed; none is left open.
        time.sleep(3.5)
        status, headers, body = read_response(slow[0], timeout=5)
        assert status == 408 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert idle[0].recv(1, socket.MSG_PEEK) == b""  # closed by the server
        assert answered_within(url, 1.0)
        for s in idle + slow:
            s.close()


def test_headers_beyond_the_limit_get_431_and_are_not_buffered(repository):
    with running_service(repository) as (url, proc):
        before = rss_mb(proc.pid)
        chunk = b"X-Big: " + b"a" * (1024 * 1024 - 9) + b"\r\n"

        def send_huge_header():
            sock = connect(url)
            sock.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\n")
            status = None
            try:
                for _ in range(50):  # up to 50 MiB of header
                    sock.sendall(chunk)
            except OSError:
                pass  # the server closed it: what we want
            status, _, body = read_response(sock, timeout=5)
            sock.close()
            return status, body

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda _: send_huge_header(), range(20)))
            peak = max(rss_mb(proc.pid) for _ in range(3))
        assert all(status in (431, 0) for status, _ in results), results  # 0: reset before the answer was read
        assert any(status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
                   for status, body in results)
        assert peak - before < 50, (before, peak)
        assert answered_within(url, 1.0)


def test_what_requests_cost_is_budgeted_and_memory_comes_back(repository):
    """24 bodies of ~10 MB at once, each costing ~70-90 MB to serve (service.core.cost; a decode process adds
    its copy of the body), under a 200 MiB budget: two fit even where one is at its peak as the next comes (at
    160 MiB a CI run once served only the first); the ones past it get 503 + Retry-After; the peak stays
    under the documented bound (idle + 1.5 x the budget, docs/reliability.md); and 30 s after, the resident
    memory is back within 25% of what it was before the burst."""
    from tests.load.bodies import json_long

    body = json_long(10 * 2**20)
    budget = 200
    with running_service(repository, ATTEND_MAX_INFLIGHT_BYTES=str(budget * 2**20)) as (url, proc):
        assert httpx.post(f"{url}{body.path}", content=body.content, headers=body.headers, timeout=60) \
            .status_code == 200
        time.sleep(3)
        before = rss_mb(proc.pid)

        def send(_):
            try:
                r = httpx.post(f"{url}{body.path}", content=body.content, headers=body.headers, timeout=120)
                return r.status_code, r.headers.get("retry-after"), r.json()
            except httpx.HTTPError as e:
                return "error", None, repr(e)

        with sampling_rss(proc.pid) as peak, ThreadPoolExecutor(24) as pool:
            results = list(pool.map(send, range(24)))
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 503}, results
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1
        refused = [r for r in results if r[0] == 503]
        assert all(r[1] == "1" and r[2]["error"]["code"] == "overloaded" for r in refused)
        assert all("ATTEND_MAX_INFLIGHT_BYTES" in r[2]["error"]["message"] for r in refused)
        assert max(peak) - before < 1.5 * budget, (before, max(peak))
        deadline = time.monotonic() + 30
        while rss_mb(proc.pid) > 1.25 * before and time.monotonic() < deadline:
            time.sleep(1)
        assert rss_mb(proc.pid) <= 1.25 * before, (before, rss_mb(proc.pid))


_QUEUE = """
import json, sys, httpx, numpy as np
from concurrent.futures import ThreadPoolExecutor
array = np.random.default_rng(1).normal(size=(1, 2000, 64)).tolist()  # 8 MB of JSON, ~60 ms of attention
big = json.dumps({"model": "dot_product", "queries": array, "keys": array, "values": array,
                  "return_weights": False}).encode()
with ThreadPoolExecutor(64) as pool:
    codes = list(pool.map(lambda _: httpx.post(sys.argv[1] + "/attend", content=big, timeout=120,
                                               headers={"content-type": "application/json"}).status_code, range(64)))
print(json.dumps(codes))
"""


@contextlib.contextmanager
def queue_of_large_requests(repository):
    """The service on one core (one inference and one ORT thread), and 64 clients on the other core
    sending it 8 MB requests (~8 s of its work): yields (url, the queue's process)."""
    import subprocess
    import sys

    with running_service(repository, prefix=(*AHEAD, "taskset", "-c", "0"), ATTEND_INFERENCE_THREADS="1",
                         ATTEND_INTRA_OP_THREADS="1", ATTEND_MAX_INFLIGHT_BYTES=str(16 << 30)) as (url, _):
        queue = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", _QUEUE, url], stdout=subprocess.PIPE,
                                 text=True)
        yield url, queue


def with_deadline_of_2s(url: str) -> tuple[int, bytes, float]:
    """One more 8 MB request, sent with X-Request-Timeout-Ms: 2000 by a client that reads while it
    sends (as a browser does: it sees the answer when it comes, even while its body is still going
    out): (status, body, seconds until the answer)."""
    array = np.random.default_rng(1).normal(size=(1, 2000, 64)).tolist()
    big = json.dumps({"model": "dot_product", "queries": array, "keys": array, "values": array,
                      "return_weights": False}).encode()
    sock = connect(url)
    start = time.monotonic()
    head = (b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Timeout-Ms: 2000\r\nContent-Length: %d\r\n\r\n" % len(big))
    threading.Thread(target=lambda: _send_quietly(sock, head + big), daemon=True).start()
    status, _, body = read_response(sock, timeout=30)
    waited = time.monotonic() - start
    sock.close()
    return status, body, waited


def vanishing_clients(url: str, count: int = 200) -> str:
    """`count` clients that send half a body, then close their connections; /metrics afterwards."""
    socks = []
    for _ in range(count):
        sock = connect(url)
        sock.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"model\": \"additive\", \"queries\": [[[")
        socks.append(sock)
    time.sleep(0.5)
    for sock in socks:
        sock.close()  # the body never completes
    time.sleep(1.0)
    return httpx.get(f"{url}/metrics").text


def requests_counted(metrics: str, status: str) -> float:
    """attend_requests_total of one status, summed over the models."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("attend_requests_total{") and f'status="{status}"' in line)


def test_a_deadline_covers_every_wait(repository):
    """Behind a queue of large requests (their bodies coming in, their decodes on one decode thread,
    their runs on one core), a request sent with X-Request-Timeout-Ms: 2000 is answered within 3 s:
    a 504 if its turn had not come, not when it comes (the queue is ~8 s of work). The queue is sent
    from another process, so that this one's client measures the service and not its own threads.
    (Each wait, alone and certain, is in tests/service/test_batching.py.)"""
    with queue_of_large_requests(repository) as (url, queue):
        time.sleep(1.0)  # the bodies are coming in, their decodes and runs queued
        status, body, waited = with_deadline_of_2s(url)
        statuses = json.loads(queue.communicate(timeout=300)[0])
        # Answered within its deadline and a margin: late, a 504; taken before its deadline, its answer
        # (the deadline covers the waits before a run, not the run: docs/errors.md). The margin is the
        # event loop's delay while the decode thread holds the GIL and 64 bodies come in, and the run of
        # a batch taken just before the deadline: 2.1-2.35 s for the 504 in runs of this and of the code
        # before, 2.55 s once in a full CI run; 2.22-2.27 s for the 200 in 2 of 7 runs once the requests
        # left no garbage to collect (09e5ed5: a faster service reaches this request sooner).
        assert waited < 3.0, (waited, status)
        assert status == 200 and json.loads(body)["outputs"] or status == 504 and json.loads(body)["error"][
            "code"] == "deadline_exceeded", (status, body[:200])
        assert set(statuses) == {200}


def test_clients_that_vanish_are_not_server_errors(repository, tmp_path):
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info") as (url, _):
        metrics = vanishing_clients(url)
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    assert requests_counted(metrics, "499") == 200
    assert not [line for line in metrics.splitlines() if line.startswith('attend_requests_total{')
                and 'status="500"' in line and not line.endswith(" 0.0")]


def test_the_request_limit_answers_json_with_retry_after_and_spares_health(repository):
    with running_service(repository, ATTEND_MAX_CONNECTIONS="4", ATTEND_BODY_TIMEOUT_S="30") as (url, _):
        holders = []
        for _ in range(4):  # four requests in progress, their bodies pending
            sock = connect(url)
            sock.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            holders.append(sock)
        time.sleep(0.3)
        refused = httpx.post(f"{url}/attend", content=TOY, headers={"content-type": "application/json"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded" and "ATTEND_MAX_CONNECTIONS" in refused.text
        assert httpx.get(f"{url}/health/live").status_code == 200  # health is never refused for load
        assert httpx.get(f"{url}/health/ready").status_code == 200
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        for sock in holders:
            sock.close()
        time.sleep(0.3)
        assert httpx.post(f"{url}/attend", content=TOY, headers={"content-type": "application/json"}).status_code == 200


def test_a_body_that_stalls_is_closed(repository):
    with running_service(repository, ATTEND_BODY_TIMEOUT_S="1.5") as (url, _):
        sock = connect(url)
        sock.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                     b"\r\n{\"model\"")
        start = time.monotonic()
        status, _, body = read_response(sock, timeout=10)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert 1.4 < time.monotonic() - start < 4


def test_readiness_says_whether_every_model_is_served(repository, tmp_path):
    import shutil

    repo = shutil.copytree(repository, tmp_path / "repo")
    (repo / "dot_product" / "1" / "model.onnx").write_bytes(b"broken")
    log_path = tmp_path / "service.log"
    with running_service(repo, ATTEND_SKIP_BROKEN_MODELS="true", timeout=60, ready_path="/health/live",
                         log_path=log_path) as (url, _):
        ready = httpx.get(f"{url}/health/ready")
        assert ready.status_code == 503
        assert "dot_product" in ready.json()["error"]["message"]
        assert str(tmp_path) not in ready.text and str(repo) not in httpx.get(f"{url}/models").text
        attend = httpx.post(f"{url}/attend", json={"queries": [[[1.0, 2.0]]], "keys": [[[1.0, 2.0]]],
                                                    "values": [[[1.0]]]})
        assert attend.status_code == 503 and str(repo) not in attend.text
        assert httpx.post(f"{url}/attend", content=TOY, headers={"content-type": "application/json"}).status_code == 200
    # Tried once: the server's catch-up with the repository at its start (as SIGHUP's) waits for a new version.
    log = log_path.read_text()
    assert log.count("skipping model dot_product") == 1 and "load of model dot_product" not in log, log


def test_the_transport_takes_its_limits_from_the_apps_settings(settings, monkeypatch):
    """An app built with other settings than the environment's: the connection guard's limits are the
    app's (GracefulServer hands its protocol a guard of the app's settings), and a refusal under /v2
    has the Open Inference Protocol's error body."""
    from service.http.app import create_app
    from tests.server import free_port, graceful_in_thread

    monkeypatch.delenv("ATTEND_MAX_HEADER_BYTES", raising=False)  # the environment's: 64 KiB
    small = settings.model_copy(update={"max_header_bytes": 2048, "port": free_port()})
    with graceful_in_thread(create_app(small)):
        url = f"http://127.0.0.1:{small.port}"
        for path, body_of in (("/attend", lambda b: b["error"]["code"]), ("/v2/models/additive/infer", set)):
            sock = connect(url)
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 4096}\r\n".encode())
            status, _, body = read_response(sock, timeout=5)
            sock.close()
            assert status == 431, (path, status, body)
            assert body_of(json.loads(body)) in ("headers_too_large", {"error"}), body
        assert httpx.get(f"{url}/health/live").status_code == 200
