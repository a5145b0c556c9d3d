"""bench/ray_serve.py (`make bench-ray`) for real, short: `python -m service` and Serve's proxy, one replica,
over HTTP (W1, W3) and gRPC (W1grpc, through Serve's gRPC proxy); every row answered without an error, and
the section --out writes. `make test-ray` (the ray extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_row_is_served_through_http_and_grpc(repository, tmp_path):
    if shutil.which("wrk") is None:
        pytest.fail("wrk is not installed: `make tools` installs it (apt-get install wrk)", pytrace=False)
    out = tmp_path / "ray.md"
    done = subprocess.run([sys.executable, "bench/ray_serve.py", "--modes", "proxy", "--replicas", "1",
                           "--concurrency", "2", "--duration", "1", "--warmup", "1", "--repository", str(repository),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] in ("W1", "W3", "W1grpc"):
            rows[cells[0], cells[2]] = cells
    servers = ("`python -m service`", "Serve, proxy (default)")
    assert sorted(rows) == sorted((w, s) for w in ("W1", "W3", "W1grpc") for s in servers), rows
    for (_, server), cells in rows.items():
        assert cells[1] == "2" and cells[3] == "1", cells
        assert float(cells[4]) > 0 and cells[8] == "0", cells  # requests/s, errors
        assert float(cells[9]) == 1.0 if server == servers[0] else 0 < float(cells[9]), cells
    assert "W1grpc: gRPC ModelInfer" in out.read_text()
    assert "command: `python bench/ray_serve.py --modes proxy" in out.read_text().lower()
