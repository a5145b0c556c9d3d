"""bench/metrics_files.py: a real 2-worker service's metrics files, copied as dead workers; folded, a scrape
reads two files more however many died, and the same values."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow


def test_the_table_counts_files_kept_and_folded(repository):
    done = subprocess.run([sys.executable, "bench/metrics_files.py", "--repository", str(repository),
                           "--dead", "0,3", "--scrapes", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {int(m[0]): [int(x) for x in m[1:]] for m in
            re.findall(r"^\| (\d+) \| (\d+), (\d+) \| [\d.]+ \| (\d+), (\d+) \| [\d.]+ \|$", done.stdout, re.M)}
    assert sorted(rows) == [0, 3], done.stdout
    files, kib, folded_files, _ = rows[0]
    assert files == folded_files and files >= 8, rows  # two workers: a counter, a histogram, live gauges each
    assert rows[3][0] == files + 3 * 2  # each dead worker's counter and histogram, kept
    assert rows[3][2] == files + 2  # counter_dead.db and histogram_dead.db
    assert rows[3][1] > kib
