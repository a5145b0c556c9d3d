"""Models that change under Ray Serve: every replica polls the repository (deploy/ray's ATTEND_POLL_S), so an
export reaches them all; model control would reach only the replica that answers it. A real local Ray and
Serve proxy, two replicas. `make test-ray` (the ray extra); `make test` leaves it out."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import numpy as np
import pytest
import yaml

from export.cli import main as export
from tests.service.test_serve import CONFIGS, on_serve, running_replicas

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

X = np.random.default_rng(0).normal(size=(1, 3, 100)).round(3).tolist()
BODY = json.dumps({"model": "multi_head", "queries": X, "keys": X, "values": X})


def test_an_export_reaches_every_replica_within_the_poll(repository, tmp_path):
    repo = shutil.copytree(repository, tmp_path / "repo")
    for name in ("additive", "dot_product", "masked_softmax", "positional_encoding", "self_attention"):
        shutil.rmtree(repo / name)  # multi_head alone: quicker to start
    env_vars = yaml.safe_load(CONFIGS[0].read_text())["applications"][0]["runtime_env"]["env_vars"]
    poll_s = float(env_vars["ATTEND_POLL_S"])
    env = env_vars | {"ATTEND_MODEL_REPOSITORY": str(repo), "ATTEND_DEVICE": "cpu", "ATTEND_LOG_LEVEL": "warning"}

    def versions(n: int = 60) -> list[str]:
        # Sequential requests: Serve's router picks either idle replica at random, so 60 reach both.
        with httpx.Client(base_url=url, timeout=60) as http:
            return [http.post("/attend", content=BODY, headers={"content-type": "application/json"}).json()[
                "model_version"] for _ in range(n)]

    with on_serve(env, 2) as url:
        assert running_replicas() == 2
        assert set(versions()) == {"1"}
        assert export(["--repository", str(repo), "--kind", "multi_head", "--seed", "7"]) == 0  # version 2
        exported = time.monotonic()
        while time.monotonic() - exported < poll_s + 30 and set(versions(20)) != {"2"}:
            time.sleep(0.5)
        assert set(versions()) == {"2"}, "a replica still serves version 1"
        assert time.monotonic() - exported < poll_s + 30  # one poll, then the load and warm-up of each
