"""bench/grpc_read.py: a row a form of tensors (raw, typed) and message size, each column a time; at 8 MiB the
guard's read holds the GIL for less than protobuf's parse of the same message, and np.array reads typed contents
in less time than np.fromiter (each by tens of times: no flaky margin)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.server import ROOT


def test_the_table_has_a_row_a_size_and_the_read_is_the_cheaper():
    done = subprocess.run([sys.executable, "bench/grpc_read.py", "--mib", "0.25,8", "--rounds", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [(m[0], *map(float, m[1:])) for m in
            re.findall(r"^\| (raw|typed) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)]
    assert [(form, round(mib)) for form, mib, *_ in rows] == [("raw", 0), ("raw", 8), ("typed", 0), ("typed", 8)], \
        done.stdout
    for _, _, parse, read, _ in rows[1::2]:
        assert read < parse / 4, done.stdout
    typed = {m[0]: (float(m[1]), float(m[2])) for m in
             re.findall(r"^\| (\w+_contents) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)}
    assert sorted(typed) == ["fp32_contents", "int64_contents"], done.stdout
    assert all(now < before / 4 for before, now in typed.values()), done.stdout
