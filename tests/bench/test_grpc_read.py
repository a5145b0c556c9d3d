"""bench/grpc_read.py: a row a message size, each column a time; at 8 MiB the guard's read holds the GIL for less
than protobuf's parse of the same message (a fraction of a millisecond against milliseconds: no flaky margin)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.server import ROOT


def test_the_table_has_a_row_a_size_and_the_read_is_the_cheaper():
    done = subprocess.run([sys.executable, "bench/grpc_read.py", "--mib", "0.25,8", "--rounds", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[float(x) for x in m] for m in
            re.findall(r"^\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)]
    assert [round(r[0]) for r in rows] == [0, 8], done.stdout
    _, parse, read, _ = rows[1]
    assert read < parse / 4, done.stdout
