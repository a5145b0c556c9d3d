"""bench/json_offload.py: a row a form of body, the decode on a thread and in a process; on the thread, a dense
body's parse holds the GIL many times longer than the process lets the main thread wait (tens of ms against a
few: no flaky margin). Served on two cores, the toy requests beside dense bodies wait a fraction as long at
their p99 with a process (85 against 13 ms, 2026-12-07)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.server import ROOT


def test_the_tables_have_a_row_a_form_and_the_process_frees_the_gil(repository):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the served table needs two cores, one for the service's decode process")
    done = subprocess.run([sys.executable, "bench/json_offload.py", "--mib", "8", "--rounds", "1", "--repository",
                           str(repository), "--served-mib", "4", "--served-seconds", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    rows = {m[0]: [float(x) for x in m[1:]] for m in
            re.findall(r"^\| ([A-Za-z ,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)}
    assert sorted(rows) == ["OIP JSON, dense", "dense", "long decimals"], done.stdout
    for form in ("dense", "OIP JSON, dense"):
        thread_wait, thread_took, process_wait, process_took = rows[form]
        assert process_wait < thread_wait / 2 and thread_wait <= thread_took and process_took > 0, done.stdout
    served = {(m[0], m[1], m[2]): [float(x) for x in m[3:]] for m in re.findall(
        r"^\| ([a-z ]+) \| ([\d,]+) \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
        done.stdout, re.M)}
    assert len(served) == 8 and all(row[0] > 0 and row[4] > 0 for row in served.values()), done.stdout
    assert served["dense", "0,1", "1"][2] < served["dense", "0,1", "0"][2] / 2, done.stdout  # p99
