"""One settings class; every field comes from an `ATTEND_*` environment variable."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.batching import BatchLimits


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ATTEND_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model_repository: Path = Path("model_repository")
    device: Literal["auto", "cuda", "cpu"] = "auto"
    workers: int = Field(1, ge=1, description="uvicorn worker processes")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # ONNX Runtime. 0 = share the machine's cores among the workers.
    intra_op_threads: int = Field(0, ge=0)
    # Requests run in this many threads at once (each session run uses intra_op_threads).
    inference_threads: int = Field(2, ge=1)
    # TF32 matmuls on the GPU differ from fp32 by ~1e-3; off unless asked for.
    cuda_tf32: bool = False
    warmup: bool = True

    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)

    # Dynamic batching (service.batching) and backpressure.
    batching: bool = True
    max_batch_rows: int = Field(64, ge=1)
    max_batch_elements: int = Field(4 * 1024 * 1024, ge=1, description="padded rows * heads * n_q * n_k")
    max_batch_wait_us: int = Field(0, ge=0, description="how long a batch's first request waits for others")
    max_queue: int = Field(256, ge=1, description="requests waiting; more get 503 + Retry-After at once")
    request_timeout_s: float = Field(30.0, gt=0, description="deadline, queue time included; "
                                     "a client may shorten it with X-Request-Timeout-Ms")
    # Bodies smaller than this are decoded on the event loop: a thread hop costs more than the parse.
    inline_decode_bytes: int = Field(16 * 1024, ge=0)

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(enabled=self.batching, max_rows=self.max_batch_rows,
                           max_elements=self.max_batch_elements, max_wait_s=self.max_batch_wait_us / 1e6,
                           max_queue=self.max_queue)

    def resolved_intra_op_threads(self) -> int:
        if self.intra_op_threads:
            return self.intra_op_threads
        return max(1, (os.cpu_count() or 1) // self.workers)


@lru_cache
def get_settings() -> Settings:
    return Settings()
