"""ATTEND_WORKERS=2, one worker killed (SIGKILL) under load: its supervisor starts another, the clients of the
other worker lose no request, each client of the killed one at most the request it had on it, and /metrics
forgets the dead worker's live gauges (its counters stay in the totals)."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from export.cli import main as export
from service.http.schemas import toy_request
from tests.server import free_port, running_service
from tests.service.test_workers import JSON, TOY, counter, worker_pids

pytestmark = pytest.mark.slow

def owner(port: int, client_port: int, pids: set[int]) -> int | None:
    """The process among `pids` that holds the server's end of the TCP connection from `client_port` to
    `port` (from /proc/net/tcp and each process's descriptors)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            inode = fields[9]
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if f"socket:[{inode}]" in links:
            return pid
    return None


class Client(threading.Thread):
    """One kept-alive connection (a new one after an error), posting the toy request until told to stop;
    every outcome recorded with the time it ended."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.http = url, httpx.Client(timeout=60)
        self.outcomes: list[tuple[float, object]] = []
        self.stop = threading.Event()

    def post(self) -> httpx.Response:
        return self.http.post(f"{self.url}/attend", content=TOY, headers=JSON)

    def local_port(self) -> int:
        """The client's port of the connection its last request went over."""
        return self.post().extensions["network_stream"].get_extra_info("client_addr")[1]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.post()
                outcome: object = r.status_code if r.json().get("outputs") is not None else "no outputs"
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            self.outcomes.append((time.monotonic(), outcome))


def test_a_killed_worker_is_replaced_and_the_other_drops_nothing(repository, tmp_path):
    log_path = tmp_path / "service.log"
    grpc_port = free_port()
    repo = shutil.copytree(repository, tmp_path / "repo")  # of its own: a new version is exported into it
    scratch = tmp_path / "tmp"  # where the metrics' folder goes
    scratch.mkdir()
    with running_service(repo, log_path=log_path, ATTEND_WORKERS="2", ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_GRPC_PORT=str(grpc_port), ATTEND_LOG_LEVEL="info", TMPDIR=str(scratch)) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while len(worker_pids(url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = worker_pids(url)
        assert len(pids) == 2

        # Three clients on each worker: new connections, each kept where the kernel put it, until both have three.
        clients: dict[int, list[Client]] = {pid: [] for pid in pids}
        for _ in range(40):
            if all(len(c) == 3 for c in clients.values()):
                break
            client = Client(url)
            pid = owner(port, client.local_port(), pids)
            assert pid in pids, pid
            if len(clients[pid]) < 3:
                clients[pid].append(client)
            else:
                client.http.close()
        assert all(len(c) == 3 for c in clients.values()), {p: len(c) for p, c in clients.items()}
        victim, survivor = sorted(pids)
        everyone = [c for cs in clients.values() for c in cs]
        for client in everyone:
            client.start()
        try:
            time.sleep(1.0)
            assert all(client.outcomes for client in everyone), "every client is sending"
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            # A new worker: the supervisor replaces the dead one, and /metrics no longer counts the dead one.
            deadline = killed + 90
            while time.monotonic() < deadline:
                now = worker_pids(url)
                if len(now) == 2 and victim not in now:
                    break
                time.sleep(0.2)
            replacement = (now - {survivor}).pop()
            assert now == {survivor, replacement} and replacement != victim, now
            time.sleep(1.0)  # the load goes on with the new worker up
        finally:
            for client in everyone:
                client.stop.set()
            for client in everyone:
                client.join(timeout=60)

        assert proc.poll() is None  # the supervisor lives on
        for client in clients[survivor]:  # the other worker's clients lost nothing, before, during and after
            outcomes = {o for _, o in client.outcomes}
            assert outcomes == {200}, outcomes
            assert sum(1 for t, _ in client.outcomes if t > killed) > 5
        for client in clients[victim]:  # the killed one's: at most the request it had, then served elsewhere
            failed = [(t - killed, o) for t, o in client.outcomes if o != 200]
            assert len(failed) <= 1 and all(t >= 0 for t, _ in failed), failed
            assert sum(1 for t, o in client.outcomes if t > killed and o == 200) > 5

        # The replacement warms its models up (seconds; more on a busy machine): ready once it has.
        deadline = time.monotonic() + 90
        while counter(httpx.get(f"{url}/metrics").text, "attend_ready") != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        metrics = httpx.get(f"{url}/metrics").text
        # Nothing in flight once the clients stopped: the dead worker's gauge left the sum with it.
        assert counter(metrics, "attend_requests_in_flight") == 0
        assert counter(metrics, "attend_ready") == 1
        pids_in = {int(p) for p in re.findall(r'^attend_inflight_bytes_limit\{pid="(\d+)"\}', metrics, re.M)}
        assert pids_in == {survivor, replacement}
        # The dead worker's counters stay in the totals (at least every answer a client received, its clients'
        # before the kill too), in the files of the dead: its own are gone, or every scrape would read them.
        total = counter(metrics, "attend_requests_total", model="additive", protocol="http", status="200")
        assert total >= sum(o == 200 for c in everyone for _, o in c.outcomes)
        [folder] = scratch.glob("attend-metrics-*")
        assert not list(folder.glob(f"*_{victim}.db")) and (folder / "counter_dead.db").exists(), os.listdir(folder)

        # The new worker serves gRPC too, on the shared port (SO_REUSEPORT): calls on new connections
        # reach both workers.
        before = {pid: counter(metrics, "attend_worker_served", pid=str(pid)) for pid in (survivor, replacement)}
        queries = np.asarray(toy_request()["queries"], dtype=np.float32)
        keys = np.asarray(toy_request()["keys"], dtype=np.float32)
        values = np.asarray(toy_request()["values"], dtype=np.float32)
        for _ in range(24):
            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client:
                inputs = []
                for name, array in (("queries", queries), ("keys", keys), ("values", values)):
                    tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
                    tensor.set_data_from_numpy(array)
                    inputs.append(tensor)
                result = grpc_client.infer("additive", inputs)
                assert result.as_numpy("outputs").shape == (2, 1, 4)
        metrics = httpx.get(f"{url}/metrics").text
        after = {pid: counter(metrics, "attend_worker_served", pid=str(pid)) for pid in (survivor, replacement)}
        assert sum(after.values()) - sum(before.values()) == 24
        assert after[replacement] > before[replacement], (before, after)

        # Every worker, the replacement too, chose its graphs by the times the start's check measured (with
        # nothing else running), not by its own taken while the others timed or served: the same times, to
        # the last digit, and the same choice, whichever worker a client reaches.
        workers = {survivor, replacement}
        for name in TIMED:
            seen = {pid: choice_of(url, port, pid, workers, name) for pid in workers}
            assert seen[survivor] == seen[replacement], (name, seen)
            assert seen[survivor][2], (name, "timed")
        # A version loaded while serving (SIGHUP): one worker times its graphs, holding the version's lock, and the
        # other waits and takes its times. Each timing its own, under the other's timing, they would differ.
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            seen = {pid: choice_of(url, port, pid, workers, "multi_head") for pid in workers}
            if all(version == 2 for version, *_ in seen.values()):
                break
            time.sleep(0.5)
        assert seen[survivor] == seen[replacement] and seen[survivor][0] == 2, seen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)

    log = log_path.read_text()
    assert f"worker {victim} ended (signal 9); worker {replacement} started in its place" in log
    assert "Traceback" not in log
    for name in TIMED:  # the check's line, then each worker's (the replacement's too) naming the check's times
        lines = re.findall(rf"model {name} runs (.*)", log)
        assert lines[1:4] == [lines[0] + TAKEN] * 3, lines
        # multi_head's version 2: one worker timed it, the other took its times
        assert len(lines) == (6 if name == "multi_head" else 4), lines
        assert name != "multi_head" or sorted(lines[4:], key=len) == [lines[4].removesuffix(TAKEN),
                                                                       lines[4].removesuffix(TAKEN) + TAKEN], lines


TIMED = ("dot_product", "multi_head", "self_attention")  # the models with several graphs on the CPU
TAKEN = " (timed by another process)"


def choice_of(url: str, port: int, pid: int, pids: set[int], name: str) -> tuple[int, list, list]:
    """GET /models/{name}'s version, graphs (less the runs) and graph_timings, as worker `pid` answers them. New
    connections are kept open till one reaches it: a worker takes them while it holds fewer than the others."""
    with contextlib.ExitStack() as stack:
        for _ in range(40):
            http = stack.enter_context(httpx.Client(timeout=30))
            response = http.get(f"{url}/models/{name}")
            client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
            if owner(port, client_port, pids) == pid:
                described = response.json()
                graphs = [{k: v for k, v in g.items() if k != "runs"} for g in described["graphs"]]
                return described["version"], graphs, described["graph_timings"]
    raise AssertionError(f"no connection reached worker {pid}")


def test_with_workers_a_repository_that_cannot_be_served_stops_the_start_in_one_line(tmp_path):
    """The supervisor loads the models in a process of its own (none of their sessions, on CUDA none of its
    context, stays in it); what fails there stops the start as it does without workers."""
    env = os.environ | {"ATTEND_WORKERS": "2", "ATTEND_MODEL_REPOSITORY": str(tmp_path / "nowhere"),
                        "ATTEND_GRPC_PORT": "0", "ATTEND_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-m", "service"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(f"cannot start: model repository {tmp_path / 'nowhere'} does not exist "
                                        "(run `python -m export`)"), done.stderr
    assert "Traceback" not in done.stderr


def test_with_workers_and_no_writable_dev_shm_the_start_says_so_in_one_line(repository):
    """The workers' processes share semaphores and memory through /dev/shm: where it is read-only, the start
    stops with that said, not a traceback. Run in a mount namespace of its own over a read-only tmpfs."""
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs root and unshare(1) to mount a read-only /dev/shm in a namespace of its own")
    env = os.environ | {"ATTEND_WORKERS": "2", "ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_GRPC_PORT": "0",
                        "ATTEND_DEVICE": "cpu", "ATTEND_PORT": str(free_port())}
    script = 'mount -t tmpfs -o ro,size=1m tmpfs /dev/shm && exec "$0" -m service'
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable], env=env, capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().endswith("cannot start: ATTEND_WORKERS=2 needs a writable /dev/shm (POSIX shared "
                                        "memory): Read-only file system"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def _start_until_spawned(repository: Path, tmp_path: Path, spawned: int) -> tuple[subprocess.Popen, list[int]]:
    """`python -m service` with two workers, once it has `spawned` children of multiprocessing's spawn at once
    (not its resource tracker): 1, the start's check; 2, the workers, just started."""
    from tests.server import children

    env = os.environ | {"ATTEND_WORKERS": "2", "ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_GRPC_PORT": "0",
                        "ATTEND_DEVICE": "cpu", "ATTEND_PORT": str(free_port()), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "service"], env=env, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        found = []
        for pid in children(proc.pid):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        if len(found) == spawned:
            assert list(tmp_path.glob("attend-timings-*"))
            return proc, found
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"never {spawned} spawned: {proc.communicate()[1][-2000:]}")


def test_with_workers_sigterm_during_the_starts_check_leaves_nothing_behind(repository, tmp_path):
    """The start loads the repository in a process of its own first (check_in_a_process). SIGTERM meanwhile
    left that process running for good, the models in its memory, and the start's folder on disk."""
    proc, [check] = _start_until_spawned(repository, tmp_path, 1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)  # (the check, had it lived on, would hold stderr open)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    deadline = time.monotonic() + 10
    while Path(f"/proc/{check}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{check}").exists(), "the check outlived the start"
    assert not list(tmp_path.glob("attend-timings-*"))
    assert "serving on" not in stderr and "Traceback" not in stderr, stderr


def test_sigterm_another_thread_takes_waits_until_the_check_has_started():
    """The start holds SIGTERM while the check's process starts; the mask is the main thread's, so a SIGTERM
    for the process landed on another thread (the log flusher's), and its handler raised in the main thread
    midway through start(): the check read its arguments half written (an EOFError traceback, a busy core)."""
    from service.http.server import _signals_blocked, exit_on_stop_signals

    go, sent = threading.Event(), threading.Event()

    def kill() -> None:  # started before the block, so SIGTERM is not blocked here: the kernel gives it this thread
        go.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        sent.set()

    thread = threading.Thread(target=kill)
    thread.start()
    steps = []
    with pytest.raises(SystemExit) as stopped, exit_on_stop_signals():
        with _signals_blocked(signal.SIGTERM, signal.SIGINT):
            go.set()
            sent.wait()
            for _ in range(1000):  # Python runs the handler in this thread at one of these
                time.sleep(0)
            steps.append("started")
        steps.append("after")
    thread.join()
    assert steps == ["started"]
    assert stopped.value.code == 128 + signal.SIGTERM


def test_with_workers_a_check_that_dies_stops_the_start_in_one_line(repository, tmp_path):
    """(Its process pool's BrokenProcessPool was a traceback.)"""
    proc, [check] = _start_until_spawned(repository, tmp_path, 1)
    os.kill(check, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1, stderr
    assert stderr.strip().endswith("cannot start: the check of the repository ended with exit code -9"), stderr
    assert "Traceback" not in stderr and not list(tmp_path.glob("attend-timings-*"))


def test_with_workers_sigterm_while_they_start_stops_them_all_with_no_replacement(repository, tmp_path):
    """SIGTERM's handler came while uvicorn's supervisor waited on a worker's answer; a worker that the signal
    ended as it started was then replaced, over the listening socket the handler had closed: a traceback, exit 1."""
    proc, workers = _start_until_spawned(repository, tmp_path, 2)
    time.sleep(0.7)  # past the supervisor's first wait (0.5 s): it pings a worker still importing, and waits
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "in its place" not in stderr, stderr[-3000:]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not list(tmp_path.glob("attend-timings-*")) and not list(tmp_path.glob("attend-metrics-*"))


def test_the_workers_stop_when_their_supervisor_is_killed(repository):
    """SIGKILL to the supervisor (or a crash) left its workers serving for good, and the port taken: the next
    start failed ("address already in use"). Each now gets SIGTERM from the kernel, drains and exits."""
    from tests.server import proc_stat

    def alive(pid: int) -> bool:
        try:
            return proc_stat(pid)[0] != "Z"
        except OSError:
            return False

    with running_service(repository, ATTEND_WORKERS="2") as (url, proc):
        deadline = time.monotonic() + 60  # ready once one worker is; the other may still be loading
        while len(workers := worker_pids(url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if alive(pid)]
        with socket.socket() as free:  # the next start can listen there (as uvicorn binds: SO_REUSEADDR)
            free.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            free.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))


def test_as_a_containers_pid_1_sigterm_while_the_models_load_stops_the_start(repository, tmp_path):
    """A container's PID 1 ignores a signal it has no handler for: `docker stop` while the models loaded waited its
    10 s for SIGKILL (and the service, the SIGTERM lost, started serving). Now the start exits at once."""
    from tests.server import children

    unshare = ["unshare", "--pid", "--kill-child=SIGKILL"]  # (--kill-child: the service goes with it, whatever happens)
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run([*unshare, "true"]).returncode:
        pytest.skip("needs root and unshare(1) to run the service as PID 1 of a PID namespace of its own")
    log_path = tmp_path / "service.log"
    env = os.environ | {"ATTEND_MODEL_REPOSITORY": str(repository), "ATTEND_GRPC_PORT": "0", "ATTEND_DEVICE": "cpu",
                        "ATTEND_PORT": str(free_port())}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*unshare, sys.executable, "-m", "service"], env=env, stderr=log,
                                cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while "loaded model additive" not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    [service] = children(proc.pid)  # PID 1 inside
    os.kill(service, signal.SIGTERM)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM while the models loaded did not stop it: " + log_path.read_text()[-2000:])
    assert code in (128 + signal.SIGTERM, 0), log_path.read_text()[-2000:]
    assert "Traceback" not in log_path.read_text()


def test_with_workers_a_worker_that_cannot_load_stops_the_start_in_one_line(repository, tmp_path):
    """The repository changed between the start's check and the workers' loads (or a worker ran out of GPU
    memory): a failed lifespan logged a traceback, and the service exited 0."""
    repo = shutil.copytree(repository, tmp_path / "repo")
    proc, _ = _start_until_spawned(repo, tmp_path, 2)  # the check passed; the workers import, then load
    shutil.rmtree(repo)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-3000:]
    assert f"cannot start: model repository {repo} does not exist" in stderr, stderr[-3000:]
    assert re.search(r"cannot start: worker \d+ could not \(its lines above say why\); stopping", stderr)
    assert "Traceback" not in stderr and not list(tmp_path.glob("attend-timings-*"))


def test_a_replacement_that_cannot_start_is_tried_again_while_the_other_serves(repository, tmp_path):
    """Before, a worker that died while the repository could not be loaded (moved, a broken newest version, the
    GPU full) stopped the whole service: its replacement's failed start was taken for the start's own. Only
    when no worker is left does it stop, exit code 1."""
    log_path = tmp_path / "service.log"
    repo, away = tmp_path / "repo", tmp_path / "away"
    shutil.copytree(repository, repo)
    with running_service(repo, log_path=log_path, ATTEND_WORKERS="2", ATTEND_INTRA_OP_THREADS="1",
                         ATTEND_LOG_LEVEL="info") as (url, proc):
        deadline = time.monotonic() + 60
        while len(worker_pids(url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        victim, survivor = sorted(worker_pids(url))
        repo.rename(away)
        os.kill(victim, signal.SIGKILL)
        with httpx.Client() as client:  # one connection: the survivor's, as the victim's are gone
            deadline = time.monotonic() + 90
            while "next try in 2 s" not in log_path.read_text() and time.monotonic() < deadline:
                assert client.post(f"{url}/attend", content=TOY, headers=JSON).status_code == 200
                time.sleep(0.1)
        assert proc.poll() is None and worker_pids(url) == {survivor}
        away.rename(repo)
        deadline = time.monotonic() + 90
        while len(worker_pids(url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(worker_pids(url) - {survivor}) == 1

        repo.rename(away)  # then both ended, and neither can start: nothing is left to serve
        for pid in worker_pids(url):
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=90) == 1
    text = log_path.read_text()
    assert re.search(r"worker \d+ could not start in place of one that ended \(its lines above say why\); next try "
                     r"in 1 s; 1 of 2 workers serve", text), text[-3000:]
    assert re.search(r"worker \d+ started, to try again", text) and "cannot start: worker" not in text
    assert "no worker could start in place of those that ended (their lines above say why); stopping" in text
    assert "Traceback" not in text
