"""Triton's perf_analyzer (2.60, the binary itself, through Debian 13's loader) drives the service's
Open Inference Protocol, over HTTP, gRPC and gRPC's stream, and with system shared memory: a short sweep,
the binary's exit status checked, a table of real numbers, and its server-side breakdown from the service's
statistics extension."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
                    reason="not a Debian machine (no apt-get or dpkg-deb): the script runs perf_analyzer "
                           "through Debian 13's libc, which it fetches with them")
@pytest.mark.parametrize(("protocol", "shared_memory"), [("http", "none"), ("grpc", "none"), ("grpc-stream", "none"),
                                                      ("http", "system"), ("grpc", "system")])
def test_perf_analyzer_runs_against_the_service(repository, protocol, shared_memory):
    command = ["bash", "bench/perf_analyzer.sh", "--protocol", protocol, "--repository", str(repository),
               "--shared-memory", shared_memory,
               "--concurrency", "1 2",
               # Windows of 1 s, 3 a point (the fewest its stabilisation can judge): perf_analyzer keeps
               # what it sends and receives (~1.6 MB a request), and in full test runs its concurrency-4
               # point ran on past 6 GB (both tries, twice, the last on the faster binary path) where
               # alone it peaks under 1.3 GB. Concurrency 1 and 2 are what this checks; the sweep to 16
               # is `make perf-analyzer`.
               "--seconds", "1", "--max-trials", "3", "--max-memory-gb", "6",
               # What is tested is that it runs and reports, not how steady this shared machine is:
               # at 30% and at 100% it failed now and then to call its windows stable. 999 (GenAI-Perf's
               # default) takes the first 3 windows as they come.
               "--stability", "999"]
    for _ in range(3):
        # The script's service runs in this interpreter (its default, .venv, is not every checkout's venv).
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                                env=os.environ | {"PYTHON": sys.executable})
        # perf_analyzer passed the memory bound, or a window took over twice the others' latency
        # (now and then in full test runs): again, at most twice more. The script puts
        # perf_analyzer's own log on stderr.
        if not (result.returncode == 3 or (result.returncode == 2
                                           and "Failed to obtain stable measurement" in result.stderr)):
            break
        print(result.stdout[-1000:], result.stderr[-1000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    flags = {"grpc-stream": "-i grpc --streaming"}.get(protocol, f"-i {protocol}") + (
        " --shared-memory system" if shared_memory == "system" else "")
    assert f"(`{flags} -b 8`" in result.stdout, result.stdout[:500]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \|", result.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2"], result.stdout
    assert all(int(r[1]) > 0 and int(r[2]) == pytest.approx(8 * int(r[1]), abs=8) for r in rows)
    # Its server-side breakdown, from GET /v2/models/dot_product/stats (the statistics extension), per point.
    server = re.findall(r"^Concurrency (\d+):\n  Server: *\n    Inference count: (\d+)\n    Execution count: (\d+)\n"
                        r"    Successful request count: (\d+)\n    Avg request latency: (\d+) usec \(overhead (\d+) "
                        r"usec \+ queue (\d+) usec \+ compute input (\d+) usec \+ compute infer (\d+) usec \+ "
                        r"compute output (\d+) usec\)$", result.stdout, re.MULTILINE)
    assert [s[0] for s in server] == ["1", "2"], result.stdout
    for concurrency, inferences, executions, requests, latency, overhead, queue, c_in, c_infer, c_out in (
            map(int, s) for s in server):
        # 8 rows a request, a run at most a request (W2's weights fill a batch alone); a request can be run in
        # one window and answered in the next.
        assert requests > 0 and 0 < executions <= requests + concurrency, result.stdout
        assert inferences == pytest.approx(8 * requests, abs=8 * concurrency), result.stdout
        # The parts are each an average rounded down (perf_analyzer's); the overhead is what is left.
        assert c_infer > 0 and latency - 3 < overhead + queue + c_in + c_infer + c_out <= latency, result.stdout
