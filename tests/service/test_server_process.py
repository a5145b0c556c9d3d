"""The real server process on a free port, over real HTTP."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from service.http.schemas import toy_request
from tests.server import ROOT, proc_stat, running_service

pytestmark = pytest.mark.slow


def test_real_process_serves_the_toy_example(repository):
    with running_service(repository) as (url, proc):
        with httpx.Client(base_url=url, timeout=10) as http:
            response = http.post("/attend", json=toy_request())
            assert response.status_code == 200
            np.testing.assert_allclose(response.json()["outputs"], [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)
            bad = http.post("/attend", json=toy_request() | {"valid_lens": [2, 11]})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "valid_lens"
            assert [m["provider"] for m in http.get("/models").json()["models"]] == ["CPUExecutionProvider"] * 6
            assert "attend_requests_total" in http.get("/metrics").text
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises SIGTERM after a graceful shutdown: -15 here, 143 in a shell
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)


def test_the_attention_graphs_run_without_a_line_in_the_log(repository, tmp_path):
    """multi_head's and self_attention's CPU graphs return the weights as the `Attention` node makes them,
    whose n_k onnx's shape inference sizes 0: ONNX Runtime would warn at every run that the real shape is
    not that (export.repository.CPU_GRAPH_LOG_SEVERITY). Nothing of it reaches the service's log."""
    log = tmp_path / "service.log"
    rng = np.random.default_rng(0)
    with running_service(repository, log_path=log) as (url, _), httpx.Client(base_url=url, timeout=10) as http:
        for n in (3, 7):
            x = rng.normal(size=(2, n, 100)).tolist()
            for body in ({"model": "multi_head", "queries": x, "keys": x, "values": x, "valid_lens": [2, n]},
                         {"model": "self_attention", "queries": x, "valid_lens": [1, n]}):
                response = http.post("/attend", json=body)
                assert response.status_code == 200, response.text
                assert np.shape(response.json()["attention_weights"]) == (2, 5, n, n)
    text = log.read_text()
    assert "onnxruntime" not in text and "Expected shape" not in text, text


def test_missing_repository_stops_the_process_with_the_reason(tmp_path):
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(tmp_path / "nowhere"), "ATTEND_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert f"model repository {tmp_path / 'nowhere'} does not exist" in result.stderr


def test_a_start_without_cuda_says_so_in_one_line(repository, tmp_path):
    """ATTEND_DEVICE=auto on a machine without CUDA: one clear line, none of ONNX Runtime's errors."""
    import onnxruntime as ort

    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_DEVICE="auto", ATTEND_LOG_LEVEL="info") as (url, _):
        providers = {m["provider"] for m in httpx.get(f"{url}/models").json()["models"]}
    if providers == {"CUDAExecutionProvider"}:
        pytest.skip("this machine has CUDA")
    text = log.read_text()
    said = [line for line in text.splitlines() if "CUDA" in line]
    assert len(said) == 1, text
    assert "no CUDA here (" in said[0] and "the CPU execution provider serves every model" in said[0]
    if "CUDAExecutionProvider" in ort.get_available_providers():  # onnxruntime-gpu: it did try, and said why
        reason = re.search(r"no CUDA here \((.*)\): ", said[0]).group(1)
        assert reason and reason != "no reason logged", said[0]
    assert "[E:onnxruntime" not in text and "Failed to load library" not in text and "Traceback" not in text
    assert f"serving on {url}" in text


def test_cuda_required_without_cuda_is_one_line_and_exit_1(repository):
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_DEVICE": "cuda"}
    result = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    if result.returncode == 0:
        pytest.skip("this machine has CUDA")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1
    assert len(lines) == 1, result.stderr
    assert "cannot start: ATTEND_DEVICE=cuda but CUDA cannot be used (" in lines[0]


def test_the_server_runs_uvloop_and_httptools(repository, tmp_path):
    log = tmp_path / "service.log"
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info"):
        pass
    assert "uvicorn on uvloop.Loop with GuardedProtocol" in log.read_text()  # httptools, guarded


def test_concurrent_requests_over_http_are_batched_and_each_answer_is_its_own(repository):
    """The real server: many clients at once, mixed models, shapes and valid lengths. Each answer
    equals the request's own unbatched answer (computed in this process, no batching), and some
    session runs really merged several requests."""
    from concurrent.futures import ThreadPoolExecutor

    from service.core.runtime import Registry
    from service.protocols.attend import attend
    from tests.service.test_batching import assert_same, mixed_bodies

    bodies = [b for kind in ("dot_product", "additive", "multi_head", "self_attention")
              for b in mixed_bodies(kind, 24, seed=11)]
    registry = Registry.load(repository, "cpu", 1)
    with running_service(repository) as (url, _):
        # As many kept alive as open: httpcore 1.0.9's pool closes a surplus idle connection it has already
        # given a waiting thread (encode/httpcore#1110), and that thread reads a closed socket (EBADF; a
        # fresh-clone run, 2026-11-28).
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        with httpx.Client(base_url=url, timeout=30, limits=limits) as http:
            def send(body):
                return http.post("/attend", content=body, headers={"content-type": "application/json"})

            for _ in range(3):  # three rounds: the batcher's cost model (RunCost) refined by the runs before
                with ThreadPoolExecutor(32) as pool:
                    responses = list(pool.map(send, bodies))
                for body, response in zip(bodies, responses, strict=True):
                    assert response.status_code == 200, response.text
                    assert_same(response.content, attend(body, registry))
            metrics = http.get("/metrics").text
    def total(name):
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))

    runs, served = total("attend_batch_requests_count"), total("attend_batch_requests_sum")
    assert served == 3 * len(bodies)
    assert runs < served  # merged


def test_a_response_goes_out_in_one_write(repository, tmp_path, strace):
    """The status line, headers and body of an /attend response (200 or an error) leave in one system
    call (service.http.transport.CoalescingTransport), not uvicorn's two: seen with strace on the real process."""
    trace = tmp_path / "writes.txt"
    with running_service(repository) as (url, proc), httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/attend", json=toy_request()).status_code == 200
        strace = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=write,writev,sendto,sendmsg", "-s", "4096",
                                   "-o", str(trace), "-p", str(proc.pid)], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not trace.exists() or strace.poll() is not None:  # attached once it has opened its output
            if strace.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"strace could not attach: {strace.stderr.read().decode()[-300:]}")
            time.sleep(0.05)
        time.sleep(0.5)
        answers = [http.post("/attend", json=toy_request()) for _ in range(5)]
        answers.append(http.post("/attend", json=toy_request() | {"model": "nope"}))
        time.sleep(0.3)
        strace.terminate()
        strace.wait(timeout=10)
    assert [a.status_code for a in answers] == [200] * 5 + [404]
    writes = [line for line in trace.read_text().splitlines() if '"HTTP/1.1 ' in line]
    assert len(writes) == 6, writes
    for line, answer in zip(writes, answers, strict=True):
        start = answer.content[:60].decode().replace('"', '\\"')  # as strace prints it
        assert "\\r\\n\\r\\n" + start in line  # the head, then the body, in the same write...
        assert int(line.rsplit("= ", 1)[1]) > len(answer.content)  # ... and all of it written by that call


def _binary_infer(batch: int, n: int, d: int) -> tuple[bytes, dict]:
    """A dot_product Open Inference Protocol request in binary tensors, asking only for `outputs`."""
    x = np.random.default_rng(0).normal(size=(batch, n, d)).astype(np.float32)
    inputs = [{"name": name, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
              for name in ("queries", "keys", "values")]
    head = json.dumps({"inputs": inputs,
                       "outputs": [{"name": "outputs", "parameters": {"binary_data": True}}]}).encode()
    return head + x.tobytes() * 3, {"Inference-Header-Content-Length": str(len(head)),
                                    "Content-Type": "application/octet-stream"}


def test_a_client_gone_while_queued_is_dropped_unrun_over_real_http(repository):
    """A request whose client closed its connection while it waited in the queue is dropped before its
    batch runs and counted as 499: the server's own view of the connection (uvicorn's cycle), read by
    the batching. Long runs on one inference thread keep it waiting: it is sent once the batcher is
    blocked (a long run on the thread, the next taken and waiting for it, seen on /metrics), and its
    connection closed once it is queued."""
    body, headers = _binary_infer(32, 1024, 64)  # ~0.3 s a run on one thread
    with running_service(repository, ATTEND_INFERENCE_THREADS="1", ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_MAX_WEIGHT_ELEMENTS=str(64 * 1024 * 1024),
                         ATTEND_MAX_INFLIGHT_BYTES=str(16 << 30)) as (url, _):  # each costs ~1.3 GB
        infer = f"{url}/v2/models/dot_product/infer"
        long_runs = []

        def long_run():
            long_runs.append(httpx.post(infer, content=body, headers=headers, timeout=60).status_code)

        threads = [threading.Thread(target=long_run) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30

        def taken_and_queued() -> tuple[float, float]:
            metrics = httpx.get(f"{url}/metrics").text.splitlines()
            return tuple(sum(float(line.split()[-1]) for line in metrics if line.startswith(name))
                         for name in ('attend_batch_requests_sum{model="dot_product"}', "attend_queue_depth"))

        # All three in: at least two taken (one running, one waiting for the thread, or both in one
        # run), so nothing more is taken before a long run ends.
        while (counts := taken_and_queued())[0] < 2 or sum(counts) < 3:
            assert time.monotonic() < deadline, f"the long runs never filled the thread and the queue: {counts}"
        toy = json.dumps(toy_request() | {"model": "dot_product", "queries": [[[1.0, 2.0]]] * 2,
                                          "keys": [[[1.0, 0.0]] * 10] * 2}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as gone:
            gone.sendall(b"POST /attend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(toy), toy))
            # Closed once it is queued: on a loaded machine the close could otherwise be seen before
            # its body was read (a 499 too, but with no model's name yet).
            while sum(taken_and_queued()) < 4:
                assert time.monotonic() < deadline, "the toy request never joined the queue"
        for thread in threads:
            thread.join()
        assert long_runs == [200] * 3
        metrics = httpx.get(f"{url}/metrics").text
    counts = [line for line in metrics.splitlines() if line.startswith(("attend_requests_total", "attend_client_gone"))]
    assert 'attend_client_gone_total{model="dot_product"} 1.0' in metrics, counts
    assert 'attend_requests_total{model="dot_product",protocol="http",status="499"} 1.0' in metrics
    assert 'attend_batch_requests_count{model="dot_product"} 3.0' in metrics  # the long runs only


HANGS = """
import http.server, os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a service that does not stop
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker of it
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
print("child", child.pid, file=sys.stderr, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def test_a_service_that_does_not_stop_is_reported_with_its_stacks_and_killed_with_its_workers(tmp_path, capfd):
    """What a test gets when the service it started hangs on SIGTERM: the stacks of every thread of it
    and of its workers, and its log's end, in its report; and no process of it left behind."""
    log = tmp_path / "service.log"
    with running_service(tmp_path, command=[sys.executable, "-c", HANGS, "{port}"], log_path=log,
                         stop_timeout=1) as (url, proc):
        assert httpx.get(f"{url}/health/ready").status_code == 200
    child = int(re.search(r"child (\d+)", log.read_text()).group(1))
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    report = capfd.readouterr().err
    assert f"--- process {proc.pid}, still running" in report and f"--- process {child}, still running" in report
    assert "serve_forever" in report  # py-spy's stack of the main thread
    assert "--- the end of its log:\nchild " in report


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by whoever adopted it, does not)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False
