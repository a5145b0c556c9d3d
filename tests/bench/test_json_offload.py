"""bench/json_offload.py: a row a form of body, the decode on a thread and in a process; on the thread, a dense
body's parse holds the GIL many times longer than the process lets the main thread wait (tens of ms against a
few: no flaky margin)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.server import ROOT


def test_the_table_has_a_row_a_form_and_the_process_frees_the_gil(repository):
    done = subprocess.run([sys.executable, "bench/json_offload.py", "--mib", "8", "--rounds", "1", "--repository",
                           str(repository)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    rows = {m[0]: [float(x) for x in m[1:]] for m in
            re.findall(r"^\| ([a-z ]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)}
    assert sorted(rows) == ["dense", "long decimals"], done.stdout
    thread_wait, thread_took, process_wait, process_took = rows["dense"]
    assert process_wait < thread_wait / 2 and thread_wait <= thread_took and process_took > 0, done.stdout
