"""One settings class; every field comes from an `ATTEND_*` environment variable."""

from __future__ import annotations

import difflib
import math
import os
import ssl
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.batching import BatchLimits
from service.core.gpu import auto_workers, total_memory
from service.core.request import RequestLimits


def _tls_check(load: Callable[[ssl.SSLContext], None], what: str, *paths: Path) -> None:
    """The PEM files load as a TLS server would load them; else one line saying why."""
    for path in paths:
        try:
            path.read_bytes()
        except OSError as e:
            raise ValueError(f"{path} cannot be read: {e.strerror}") from None
    try:
        load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ValueError("the key is not the certificate's (KEY_VALUES_MISMATCH)") from None
        raise ValueError(f"not {what} ({e.reason or 'PEM lib'})") from None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ATTEND_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # The Open Inference Protocol over gRPC (service/grpc), beside HTTP in the same process, on ATTEND_HOST;
    # 8001 as Triton's. 0 turns it off.
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC's port (Triton's GRPCInferenceService); 0: off")

    @field_validator("grpc_port")
    @classmethod
    def _not_http_port(cls, value: int, info: ValidationInfo) -> int:
        if value and value == info.data.get("port"):
            raise ValueError("must differ from ATTEND_PORT (gRPC and HTTP each need a port; 0 turns gRPC off)")
        return value

    # TLS on gRPC, as Triton's --grpc-use-ssl: the certificate chain and its key, PEM. With a client CA, a client
    # must show a certificate it signed (--grpc-use-ssl-mutual). HTTP stays plain: its TLS is the proxy's.
    grpc_tls_cert: Path | None = None
    grpc_tls_key: Path | None = Field(None, validate_default=True)
    grpc_tls_client_ca: Path | None = None

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, workers: Any, info: ValidationInfo) -> Any:
        """auto: a number, the same in every process (python -m service hands its workers the number)."""
        if not is_auto(workers):
            if isinstance(workers, str) and not workers.strip().isdigit():
                raise ValueError("a number of processes (1 or more), or auto")
            return workers
        device = info.data.get("device", "auto")
        # On "auto" a machine without a GPU is no reason to warn.
        gpu = None if device == "cpu" else total_memory(
            "ATTEND_WORKERS=auto does not count the GPU's memory" if device == "cuda" else None)
        return auto_workers(usable_cores(), device, gpu)

    @field_validator("grpc_tls_key")
    @classmethod
    def _key_of_the_cert(cls, key: Path | None, info: ValidationInfo) -> Path | None:
        cert = info.data.get("grpc_tls_cert")
        if (cert is None) != (key is None):
            raise ValueError("ATTEND_GRPC_TLS_CERT and ATTEND_GRPC_TLS_KEY go together: set both, or neither")
        if cert is not None and key is not None:
            _tls_check(lambda context: context.load_cert_chain(cert, key), "a PEM certificate chain and its key", cert,
                       key)
        return key

    @field_validator("grpc_tls_client_ca")
    @classmethod
    def _ca_after_the_cert(cls, ca: Path | None, info: ValidationInfo) -> Path | None:
        if ca is not None:
            if info.data.get("grpc_tls_key") is None:
                raise ValueError("needs ATTEND_GRPC_TLS_CERT and ATTEND_GRPC_TLS_KEY: mutual TLS is TLS first")
            _tls_check(lambda context: context.load_verify_locations(ca), "a PEM CA certificate", ca)
        return ca
    model_repository: Path = Path("model_repository")
    device: Literal["auto", "cuda", "cpu"] = "auto"
    workers: int = Field(1, ge=1, description="uvicorn worker processes; auto: one a usable core, on a GPU at most "
                         "8 and as many as its memory holds (service.core.gpu.auto_workers)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # ONNX Runtime. 0 = share the machine's cores among the workers.
    intra_op_threads: int = Field(0, ge=0)
    # Session runs (and large-body decodes) at once; 0 = two, or one where the process has a single
    # core (measured: on one core a second run only splits batches and competes for the GIL).
    inference_threads: int = Field(0, ge=0)
    # TF32 matmuls on the GPU differ from fp32 by ~1e-3; off unless asked for.
    cuda_tf32: bool = False
    warmup: bool = True
    # The warm-up's time, a model with several graphs, to find which runs a batch fastest by its size on this
    # machine (service.core.choice); 0: the fixed choice, and no sessions besides it.
    graph_timing_s: float = Field(0.5, ge=0, le=60, description="warm-up seconds a model to time its graphs; 0: off")
    # Denormal results of a run read 0 (MXCSR's FTZ and DAZ bits, set for each run): a masked softmax no
    # longer takes a microcode assist a score on Intel's AVX-512 cores (service.core.denormals).
    flush_denormals: bool = True
    # A model that cannot be loaded stops the service, unless this is set: then it is skipped,
    # named in the log and in GET /models, and requests for it get 503.
    skip_broken_models: bool = False
    # SIGTERM: readiness turns 503 at once; requests in flight and queued finish within this.
    grace_period_s: float = Field(30.0, ge=0)

    # Limits per request. A body's bytes as received, and (compressed ones) once inflated; what it
    # costs in memory is counted against max_inflight_bytes (service.core.cost).
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="a body's bytes, inflated ones included")
    max_inflate_ratio: float = Field(100.0, ge=1, description="a gzip or deflate body may inflate to at most this "
                                     "many times its bytes (JSON of floats compresses 2-5 times)")
    max_batch: int = Field(1024, ge=1, description="batch size of one request")
    max_sequence: int = Field(4096, ge=1, description="n_q and n_k of one request")
    max_features: int = Field(4096, ge=1, description="query, key and value sizes")
    max_weight_elements: int = Field(4 * 1024 * 1024, ge=1,
                                     description="batch * heads * n_q * n_k of one request's attention weights")

    # Dynamic batching (service.core.batching) and backpressure.
    batching: bool = True
    max_batch_rows: int = Field(64, ge=1)
    # A batch stops growing at this many padded weight elements (rows * heads * n_q * n_k): past
    # ~128K a session run is compute-bound, and merging only adds copies and head-of-line latency.
    max_batch_elements: int = Field(128 * 1024, ge=1, description="padded rows * heads * n_q * n_k")
    # How long a batch's first request may wait for others, while fewer requests are queued than the
    # server has busy clients (connections that began a request in the last 20 ms; with one, or one
    # request alone in the server, nothing waits). 0 takes only what is queued. uvloop's timers count
    # whole milliseconds (round(delay * 1000); 0 is call_soon): below 500 this is one more pass of the
    # event loop. Busy clients, not open connections: idle keep-alive connections would make every batch
    # wait for requests that never come (`python bench/batch_wait.py` weighs both).
    max_batch_wait_us: int = Field(1000, ge=0, description="how long a batch waits for the next request "
                                   "(while fewer are queued than clients are busy; 5 times this in all)")
    max_queue: int = Field(256, ge=1, description="requests waiting; more get 503 + Retry-After at once")
    # Hostile clients and overload (service.http.protocol.GuardedProtocol). Health probes are exempt from
    # the load limits: an orchestrator must not restart a busy service.
    max_connections: int = Field(512, ge=1, description="requests in progress at once; more get 503 + Retry-After")
    max_open_connections: int = Field(4096, ge=1, description="open connections; more are refused at once")
    max_inflight_bytes: int = Field(1024 * 1024 * 1024, ge=1024, description="bytes of memory the requests in "
                                    "flight may cost together (service.core.cost): a request that would pass it "
                                    "gets 503 + Retry-After (before its body is read where its length says so), "
                                    "one that would cost more than all of it 413")
    max_device_bytes: int = Field(0, ge=0, description="bytes of the GPU's memory the runs in flight of one process "
                                  "may take (service.core.cost.device_run): a request that would pass it gets 503 + "
                                  "Retry-After, one that would take more than all of it 413, before it runs; 0: on "
                                  "CUDA, a worker's share of 80% of the GPU's memory less what it holds before any "
                                  "request (service.core.gpu), on the CPU none")
    # A refusal sent while the client is still sending its body (413, 503, 401, ...) is followed by
    # reading and dropping the rest of it, so that the client, done sending, reads the answer (nginx's
    # lingering close); at most this many bytes and seconds, then the connection is closed.
    drain_bytes: int = Field(64 * 1024 * 1024, ge=0, description="bytes of a refused request's body read and "
                             "dropped so its client reads the answer")
    drain_s: float = Field(10.0, ge=0, description="seconds the rest of a refused request's body is read and dropped")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="a request's headers in all; more get 431")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this (408)")
    body_timeout_s: float = Field(10.0, gt=0, description="a body that does not progress for this long gets 408")
    min_body_rate: int = Field(32 * 1024, ge=0, description="bytes/s a body must average once body_timeout_s passed")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle kept-alive connection is closed after this")
    request_timeout_s: float = Field(30.0, gt=0, description="deadline, queue time included; "
                                     "a client may shorten it with X-Request-Timeout-Ms")
    # Bodies up to this size are decoded on the event loop: a hop to a thread costs more than their parse.
    # Larger ones go to a decode thread, so the loop keeps serving meanwhile.
    inline_decode_bytes: int = Field(1024 * 1024, ge=0)
    # JSON bodies over 1 MiB are parsed in processes of their own, this many a worker, so that the parse does
    # not hold the event loop's GIL (service.protocols.json_process); 0: on the decode threads. auto: one where
    # a worker has a core to spare; on one core the process's copies cost a large body more than the loop gains
    # (docs/reliability.md).
    json_processes: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    # Batches whose session run is predicted (the model's cost: its warm-up runs, then its runs so far;
    # service.core.runcost.RunCost) to take less than this run on the event loop; longer ones on an
    # inference thread.
    inline_run_us: int = Field(1000, ge=0)
    # ... and a request alone in the server (nothing to overlap its run with) when under this.
    alone_inline_run_us: int = Field(5000, ge=0)

    def request_limits(self) -> RequestLimits:
        return RequestLimits(batch=self.max_batch, sequence=self.max_sequence, features=self.max_features,
                             weight_elements=self.max_weight_elements)

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(enabled=self.batching, max_rows=self.max_batch_rows,
                           max_elements=self.max_batch_elements, max_wait_s=self.max_batch_wait_us / 1e6,
                           max_queue=self.max_queue, inline_run_s=self.inline_run_us / 1e6,
                           alone_inline_run_s=self.alone_inline_run_us / 1e6)

    # Access. Comma-separated; empty = no keys needed. SecretStr keeps them out of reprs and logs.
    api_keys: SecretStr = SecretStr("")
    cors_origins: str = Field("", description="comma-separated origins allowed by CORS; empty = CORS off")
    # Model control (load, unload, the repository index) is an admin operation: with admin keys set,
    # it needs one of them; without, it is off (404) unless model_control opens it (a trusted network).
    admin_keys: SecretStr = SecretStr("")
    model_control: bool = False
    # Triton's system shared memory (service.core.shm), for clients on this host: off, as Triton's
    # --allow-client-shm. Registering a region is an admin operation where admin keys are set.
    shared_memory: bool = False

    # Models that change while serving (service.core.control).
    keep_versions: int = Field(1, ge=1, description="versions of a model that stay loaded")
    poll_s: float = Field(0.0, ge=0, description="reload models whose newest version changed (less those unloaded) "
                          "every N seconds; 0: off")

    def api_key_list(self) -> tuple[bytes, ...]:
        return tuple(k.strip().encode() for k in self.api_keys.get_secret_value().split(",") if k.strip())

    def admin_key_list(self) -> tuple[bytes, ...]:
        return tuple(k.strip().encode() for k in self.admin_keys.get_secret_value().split(",") if k.strip())

    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    def cores(self) -> int:
        """A worker's share of the usable cores."""
        return max(1, usable_cores() // self.workers)

    def resolved_intra_op_threads(self) -> int:
        """ATTEND_INTRA_OP_THREADS, at most the cores this process may use (each session has a pool that big, and
        past the cores every run waits on threads that share one), or 0: the workers' share."""
        return min(self.intra_op_threads, usable_cores()) if self.intra_op_threads else self.cores()

    def resolved_inference_threads(self) -> int:
        return self.inference_threads or min(2, self.cores())

    def resolved_json_processes(self) -> int:
        return (1 if self.cores() >= 2 else 0) if self.json_processes == "auto" else self.json_processes


def is_auto(value: object) -> bool:
    """ATTEND_WORKERS=auto, as the environment may spell it."""
    return isinstance(value, str) and value.strip().lower() == "auto"


_CGROUPS, _OWN_CGROUPS = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")
# A worker's memory before any request (the idle process, its models and runtime) and per byte of its
# in-flight budget at most (ONNX Runtime's arena keeps earlier runs' memory): docs/reliability.md's sizing.
# A CUDA worker holds ~0.75 GiB before any request (docs/benchmarks.md, "Many cores, one GPU").
IDLE_BYTES, CUDA_IDLE_BYTES, BUDGET_FACTOR = 160 * 2**20, 800 * 2**20, 1.5


def usable_cores() -> int:
    """The cores this process may run on: taskset and cgroup cpusets, and a CPU quota (a container's `--cpus`, a
    pod's CPU limit) rounded up. Threads past a quota spin through it and wait for the next period."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cpu_quota(root: Path = _CGROUPS, own: Path = _OWN_CGROUPS) -> float | None:
    """The CPUs' worth of time the cgroups of this process allow a period (cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us over cpu.cfs_period_us; the least of its cgroup and those above), or None: no quota."""
    return _least(root, own, "cpu", _v1_quota, _v2_quota)


def memory_limit(root: Path = _CGROUPS, own: Path = _OWN_CGROUPS) -> int | None:
    """The bytes the cgroups of this process may hold (v2's memory.max, v1's memory.limit_in_bytes; the least
    of its cgroup and those above), or None: no limit."""
    return _least(root, own, "memory", _v1_memory, _v2_memory)


def _least(root: Path, own: Path, controller: str, read_v1: Callable[[Path], float | None],
           read_v2: Callable[[Path], float | None]) -> Any:
    found = []
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy at root
            mount, read = root, read_v2
        elif controller in controllers.split(","):  # v1: the controller's own mount ("cpu", "cpu,cpuacct")
            mounts = sorted(p for p in root.glob("*") if controller in p.name.split(",") and p.is_dir())
            if not mounts:
                continue
            mount, read = mounts[0], read_v1
        else:
            continue
        # A container sees its own cgroup at the mount; the path is the host's (v1) or "/" (v2's namespace).
        here = mount / path.lstrip("/")
        for folder in (here, *here.parents) if here.is_dir() else (mount,):
            value = read(folder)
            if value is not None:
                found.append(value)
            if folder == mount:
                break
    return min(found, default=None)


def _v2_memory(folder: Path) -> int | None:
    try:
        text = (folder / "memory.max").read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _v1_memory(folder: Path) -> int | None:
    try:
        limit = int((folder / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if limit >= 2**62 else limit  # no limit reads as the largest page-aligned number


def _v2_quota(folder: Path) -> float | None:
    try:
        limit, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        limit, period = (int((folder / f"cpu.cfs_{name}_us").read_text()) for name in ("quota", "period"))
    except (OSError, ValueError):
        return None
    return None if limit < 0 else limit / period


# ATTEND_* variables that are not the service's settings: the tools around it read them (the tests' browser,
# compose's published port and base image, the container and deploy checks). Any other ATTEND_* variable
# is a mistake, and the service refuses to start with it (a typo would otherwise leave a setting unset:
# ATTEND_API_KEY=... serving with no key at all).
TOOL_VARIABLES = frozenset({"ATTEND_PUBLISH", "ATTEND_PUBLISH_GRPC", "ATTEND_BASE_IMAGE", "ATTEND_IMAGE",
                            "ATTEND_SKIP_BROWSER",
                            "ATTEND_CHROMIUM", "ATTEND_SCREENSHOTS", "ATTEND_TOOLS", "ATTEND_DEPLOY_TOOLS",
                            "ATTEND_DOCKER_STATE"})


class UnknownSetting(ValueError):
    """An ATTEND_* variable that names no setting; the message is one line."""


def setting_names() -> list[str]:
    return [f"ATTEND_{name.upper()}" for name in Settings.model_fields]


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise UnknownSetting for the first ATTEND_* variable (any case, as pydantic-settings reads them)
    that is neither a setting nor a tool's, naming the setting it most likely meant."""
    known = set(setting_names())
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if upper.startswith("ATTEND_") and upper not in known and upper not in TOOL_VARIABLES:
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UnknownSetting(f"unknown setting {name}{hint}: every ATTEND_* variable must be one of the "
                                 "settings docs/settings.md lists")


@lru_cache
def get_settings() -> Settings:
    """The settings of the environment; UnknownSetting for an ATTEND_* variable that is none."""
    check_environment()
    return Settings()
