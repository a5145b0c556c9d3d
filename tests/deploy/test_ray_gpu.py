"""deploy/ray/serve-gpu.yaml: its settings are the service's, its replicas share one GPU without asking for more
than it, and each replica's memory and GPU budget hold what a CUDA worker was measured to hold."""

from __future__ import annotations

from pathlib import Path

import yaml

from service.config import setting_names
from service.core.gpu import SHARE, WORKER_BYTES

ROOT = Path(__file__).resolve().parents[2]
CUDA_IDLE = 800 << 20  # a CUDA worker's resident memory before any request (as tests/deploy/check_manifests.py)


def test_the_gpu_serve_config_shares_one_gpu_within_its_memory():
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "serve-gpu.yaml").read_text())
    (app,) = config["applications"]
    env = app["runtime_env"]["env_vars"]
    assert set(env) <= set(setting_names()), set(env) - set(setting_names())
    assert env["ATTEND_DEVICE"] == "cuda"
    (deployment,) = app["deployments"]
    replicas, options = deployment["num_replicas"], deployment["ray_actor_options"]
    assert replicas * options["num_gpus"] <= 1
    assert options["memory"] >= CUDA_IDLE + int(env["ATTEND_MAX_INFLIGHT_BYTES"])
    # The replicas' GPU budgets and what each holds before any request, within SHARE of an 80 GiB GPU.
    assert replicas * (int(env["ATTEND_MAX_DEVICE_BYTES"]) + WORKER_BYTES) <= SHARE * (80 << 30)
