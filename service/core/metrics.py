"""Prometheus metrics, in a registry of the app's own (several apps can live in one process).

The request path observes through `Metrics.model(name)`: each model's labelled children are looked up
once and kept, since `labels(...)` costs a lock and a dict lookup per observation.

With ATTEND_WORKERS > 1 the server sets PROMETHEUS_MULTIPROC_DIR before the workers start:
prometheus_client then keeps every worker's values in files there, and `exposition()` sums them
(its multiprocess mode), so any worker's /metrics counts all of them.

Process metrics (`process_*`: resident memory, CPU seconds, open file descriptors, start time):
prometheus_client's ProcessCollector on the app's registry. With workers, one process's values
cannot be summed from files, and the worker that answers a scrape is any of them: each scrape
reads /proc of every live worker and of their supervisor instead, a `pid` label each
(`WorkerProcesses`), as `attend_worker_served` is labelled. The garbage collector's (`python_gc_*`:
prometheus_client's GCCollector, and `_Frozen`) only without workers: no other process's can be read.

Limits and what is held against them are read at scrape time (`set_function`), so that the request
path pays nothing for them; with workers, where a scrape reads files, the in-flight bytes are
written there once a second (`sample`) by each worker, a `pid` label each.

docs/observability.md says what every family means; a test holds it to a live scrape.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import glob
import os
import re
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.process_collector import ProcessCollector

MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ

# Why the connection guard (service.http.protocol) refused a connection or a request before the app:
# the `reason` label of attend_refused_total, every one exported from the start (at 0).
REFUSALS = (
    "connections",  # 503: ATTEND_MAX_CONNECTIONS requests in progress
    "open_connections",  # 503: ATTEND_MAX_OPEN_CONNECTIONS connections open
    "header_size",  # 431: headers over ATTEND_MAX_HEADER_BYTES
    "header_timeout",  # 408: headers not in within ATTEND_HEADER_TIMEOUT_S
    "body_timeout",  # 408: no byte of the body for ATTEND_BODY_TIMEOUT_S
    "body_rate",  # 408: the body slower than ATTEND_MIN_BODY_RATE
    "drain_closed",  # a refused request's body over ATTEND_DRAIN_BYTES or ATTEND_DRAIN_S: the connection closed
)

# Why spans were lost (service.core.tracing): the `reason` label of attend_trace_spans_dropped_total.
TRACE_DROPS = ("queue_full", "export_failed")

# Up to past the default deadline (ATTEND_REQUEST_TIMEOUT_S, 30 s): a p99 near it is not read as the top bucket.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# The transports a request can come by: the `protocol` label of the request metrics.
PROTOCOLS = ("http", "grpc")


class ModelMetrics:
    """The children of one model's label, and of its statuses and protocols as they appear."""

    def __init__(self, metrics: Metrics, model: str):
        self._metrics = metrics
        self._name = model
        self._statuses: dict[tuple[int, str], Counter] = {}
        self._latencies: dict[str, Histogram] = {}
        self.inference = metrics.inference.labels(model)
        self.queue_time = metrics.queue_time.labels(model)
        self.batch_requests = metrics.batch_requests.labels(model)
        self.batch_rows = metrics.batch_rows.labels(model)

    def status(self, code: int, protocol: str = "http") -> Counter:
        child = self._statuses.get((code, protocol))
        if child is None:
            child = self._statuses[(code, protocol)] = self._metrics.requests.labels(self._name, str(code), protocol)
        return child

    def latency(self, protocol: str = "http") -> Histogram:
        child = self._latencies.get(protocol)
        if child is None:
            child = self._latencies[protocol] = self._metrics.latency.labels(self._name, protocol)
        return child


class _Frozen:
    """python_gc_frozen_objects: the objects `gc.freeze()` put out of the collector's sight (python -m service
    does at start; a model loaded or unloaded puts them back)."""

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("python_gc_frozen_objects", "Objects out of the garbage collector's sight (gc.freeze "
                                "at start; 0 once a model was loaded or unloaded)", value=gc.get_freeze_count())


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("attend_requests", "Inference requests by model, HTTP status (gRPC's: the status "
                                "its code was mapped from) and protocol (http, grpc)",
                                ["model", "status", "protocol"], registry=self.registry)
        self.latency = Histogram("attend_request_duration_seconds",
                                 "Time from the body read to the response encoded, by model and protocol",
                                 ["model", "protocol"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inference = Histogram("attend_inference_seconds", "Time inside ONNX Runtime's session run, by model",
                                   ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("attend_requests_in_flight", "Inference requests being served",
                               registry=self.registry, multiprocess_mode="livesum")
        self.queue_depth = Gauge("attend_queue_depth", "Requests waiting for a batch (all models)",
                                 registry=self.registry, multiprocess_mode="livesum")
        self.queue_time = Histogram("attend_queue_seconds", "Time a request waited in the queue, by model", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_requests = Histogram("attend_batch_requests", "Requests merged into one session run, by model",
                                        ["model"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                                        registry=self.registry)
        self.batch_rows = Histogram("attend_batch_rows", "Rows (sum of batch sizes) of one session run, by model",
                                    ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.rejected = Counter("attend_rejected", "Requests refused with 503 because the queue was full, by model",
                                ["model"], registry=self.registry)
        self.ready = Gauge("attend_ready", "1 when every model is loaded and warmed up (the least of the workers)",
                           registry=self.registry, multiprocess_mode="livemin")
        self.client_gone = Counter("attend_client_gone", "Requests whose client went away before the answer "
                                   "(also counted as status 499 in attend_requests_total)", ["model"],
                                   registry=self.registry)
        # With workers, which of them served what (a pid label each; a stopped worker's leaves).
        self.worker_served = Gauge("attend_worker_served", "Inference requests this worker answered 200 "
                                   "(pid label; only with ATTEND_WORKERS > 1)", registry=self.registry,
                                   multiprocess_mode="liveall") if MULTIPROCESS else None
        self.refused = Counter("attend_refused", "Connections and requests the connection guard refused before "
                               "the app, by reason (python -m service)", ["reason"], registry=self.registry)
        self.refusals = {reason: self.refused.labels(reason) for reason in REFUSALS}
        # The in-flight memory budget (service.core.cost.Budget): per process, so per worker (pid label).
        self.inflight_bytes = Gauge("attend_inflight_bytes", "Bytes of memory the requests in flight hold against "
                                    "ATTEND_MAX_INFLIGHT_BYTES (per worker: pid label)", registry=self.registry,
                                    multiprocess_mode="liveall")
        self.inflight_bytes_limit = Gauge("attend_inflight_bytes_limit", "ATTEND_MAX_INFLIGHT_BYTES: the budget of "
                                          "the requests in flight (per worker: pid label)", registry=self.registry,
                                          multiprocess_mode="liveall")
        self.queue_limit = Gauge("attend_queue_limit", "ATTEND_MAX_QUEUE: requests that may wait, beyond which 503 "
                                 "(summed over the workers, as attend_queue_depth is)", registry=self.registry,
                                 multiprocess_mode="livesum")
        self.request_timeout = Gauge("attend_request_timeout_seconds", "ATTEND_REQUEST_TIMEOUT_S: a request's "
                                     "deadline (a client may ask for a shorter one)", registry=self.registry,
                                     multiprocess_mode="livemax")
        # Models that change while serving (service.core.control): each load, by model and result (loaded, failed).
        self.model_loads = Counter("attend_model_loads", "Loads of a model while serving (SIGHUP, ATTEND_POLL_S, "
                                   "the load route), by result: loaded, or failed (what was serving still is)",
                                   ["model", "result"], registry=self.registry)
        self.model_load_failed = Gauge("attend_model_load_failed", "1 while the last load of a model's newest files "
                                       "failed, and an older version (or none) serves; 0 once one loaded",
                                       ["model"], registry=self.registry, multiprocess_mode="livemax")
        # Tracing (service.core.tracing): the spans sent to the receiver, and those lost, by reason.
        self.trace_spans_exported = Counter("attend_trace_spans_exported", "Spans the OTLP exporter delivered "
                                            "(tracing on: OTEL_*)", registry=self.registry)
        self.trace_spans_dropped = Counter("attend_trace_spans_dropped", "Spans lost, by reason: queue_full (the "
                                           "exporter's queue was full), export_failed (the receiver was down, "
                                           "slow or refused them)", ["reason"], registry=self.registry)
        for reason in TRACE_DROPS:
            self.trace_spans_dropped.labels(reason)
        if not MULTIPROCESS:
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)
            self.registry.register(_Frozen())
        self._used: Callable[[], float] | None = None
        # The GPU memory budget (ATTEND_MAX_DEVICE_BYTES), where there is one (track_device).
        self.device_bytes: Gauge | None = None
        self._device_used: Callable[[], float] | None = None
        self._models: dict[str, ModelMetrics] = {}

    def model_loaded(self, name: str, result: str) -> None:
        """A load while serving: "loaded" or "failed"."""
        self.model_loads.labels(name, result).inc()
        self.model_load_failed.labels(name).set(result == "failed")

    def exposition(self) -> bytes:
        """The text of /metrics: this process's registry, or every worker's values in multiprocess mode."""
        if MULTIPROCESS:
            registry = CollectorRegistry()
            registry.register(WorkerFiles())
            registry.register(WorkerProcesses())
            with _files_locked(fcntl.LOCK_SH):  # a dead worker's files or their sum, never both (fold_dead_worker)
                return generate_latest(registry)
        return generate_latest(self.registry)

    # The request path's accounting; multiprocess mode (ATTEND_WORKERS > 1) stays in here.

    def in_flight_from(self, count: Callable[[], float]) -> None:
        """The in-flight gauge, read from `count` at scrape time (counted as requests come and go in
        multiprocess mode, where a scrape reads the files, not this process)."""
        if not MULTIPROCESS:
            self.in_flight.set_function(count)

    def track_queue_depth(self, depth: Callable[[], float]) -> Gauge | None:
        """The queue-depth gauge, read from `depth` at scrape time (a Gauge.set takes a lock, and would
        run twice a request); in multiprocess mode the gauge, for the caller to set as it changes."""
        if MULTIPROCESS:
            return self.queue_depth
        self.queue_depth.set_function(depth)
        return None

    def track_limits(self, used: Callable[[], float], budget: int, max_queue: int, request_timeout_s: float) -> None:
        """The limits, and the in-flight bytes (`used`) read at scrape time; in multiprocess mode
        written by `sample`, which the caller calls every second or so."""
        self.inflight_bytes_limit.set(budget)
        self.queue_limit.set(max_queue)
        self.request_timeout.set(request_timeout_s)
        if MULTIPROCESS:
            self._used = used
            self.sample()
        else:
            self.inflight_bytes.set_function(used)

    def track_device(self, used: Callable[[], float], budget: int) -> None:
        """The budget of the runs' GPU memory (ATTEND_MAX_DEVICE_BYTES) and what the requests in flight hold of
        it, as track_limits does the in-flight bytes; exported only where there is such a budget."""
        if self.device_bytes is None:  # a second dataplane on these metrics (tests): the same gauges
            self.device_bytes = Gauge("attend_device_bytes", "Bytes of the GPU's memory (of the execution provider's) "
                                      "the runs of the requests in flight are counted to take, against "
                                      "ATTEND_MAX_DEVICE_BYTES (per worker: pid label)",
                                      registry=self.registry, multiprocess_mode="liveall")
            self.device_bytes_limit = Gauge("attend_device_bytes_limit", "ATTEND_MAX_DEVICE_BYTES: the budget of "
                                            "the runs' GPU memory (per worker: pid label)", registry=self.registry,
                                            multiprocess_mode="liveall")
        self.device_bytes_limit.set(budget)
        if MULTIPROCESS:
            self._device_used = used
            self.sample()
        else:
            self.device_bytes.set_function(used)

    def sample(self) -> bool:
        """Multiprocess mode: write what is read at scrape time otherwise (False: nothing to write)."""
        if self._used is None:
            return False
        self.inflight_bytes.set(self._used())
        if self._device_used is not None:
            self.device_bytes.set(self._device_used())  # type: ignore[union-attr]
        return True

    def request_started(self) -> None:
        if MULTIPROCESS:
            self.in_flight.inc()

    def request_ended(self) -> None:
        if MULTIPROCESS:
            self.in_flight.dec()

    def answered(self, model: str, status: int, seconds: float, protocol: str = "http") -> None:
        children = self.model(model)
        children.status(status, protocol).inc()
        children.latency(protocol).observe(seconds)
        if MULTIPROCESS:
            self.worker_served.inc()  # type: ignore[union-attr]

    def failed(self, model: str, status: int, client_gone: bool = False, protocol: str = "http") -> None:
        self.model(model).status(status, protocol).inc()
        if client_gone:  # not a server error: counted (499, as nginx does), nothing sent
            self.client_gone.labels(model).inc()

    @staticmethod
    def worker_exit() -> None:
        """A worker's live gauges leave the sum when it stops (multiprocess mode)."""
        if MULTIPROCESS:
            multiprocess.mark_process_dead(os.getpid())

    def model(self, name: str) -> ModelMetrics:
        children = self._models.get(name)
        if children is None:
            children = self._models[name] = ModelMetrics(self, name)
        return children


_LIVE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")
_SUMMED = ("counter", "histogram", "summary")  # the kinds whose files' values add up across processes


def fold_dead_worker(pid: int) -> None:
    """A worker gone (multiprocess mode): its counters and histograms added into one file a kind for all dead
    workers (`counter_dead.db`), its own files removed. The totals keep what it counted, and a scrape reads
    a file a kind, not one for every worker that ever ran: a worker replaced again and again made every scrape
    slower. Its live gauges' files are mark_process_dead's."""
    path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    with _files_locked(fcntl.LOCK_EX):
        for own in glob.glob(os.path.join(path, f"*_{pid}.db")):
            kind = os.path.basename(own).split("_")[0]
            if kind not in _SUMMED:
                continue
            dead = os.path.join(path, f"{kind}_dead.db")
            totals: dict[str, float] = {}
            for file in (dead, own) if os.path.exists(dead) else (own,):
                for key, value, _, _ in MmapedDict.read_all_values_from_file(file):
                    totals[key] = totals.get(key, 0.0) + value
            with contextlib.suppress(FileNotFoundError):  # a fold cut short: MmapedDict would keep its values
                os.unlink(dead + ".new")
            new = MmapedDict(dead + ".new")  # not *.db: a scrape reads every *.db of the folder
            for key, value in totals.items():
                new.write_value(key, value, 0.0)
            new.close()
            os.replace(dead + ".new", dead)
            os.unlink(own)


@contextlib.contextmanager
def _files_locked(how: int) -> Iterator[None]:
    """The multiprocess folder's lock: shared by a scrape, exclusive while a dead worker's files are folded."""
    fd = os.open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "fold.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


class WorkerFiles:
    """Multiprocess mode's values: prometheus_client's MultiProcessCollector, less a file a worker has just
    made and not yet sized (it holds no values yet; reading it raised struct.error, and the scrape failed)."""

    def collect(self) -> Iterable[Metric]:
        files = []
        for file in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
            with contextlib.suppress(FileNotFoundError):  # a worker's own, removed as it stops
                if os.path.getsize(file) > 0:
                    files.append(file)
        return multiprocess.MultiProcessCollector.merge(files, accumulate=True)


class WorkerProcesses:
    """Multiprocess mode's process metrics: ProcessCollector's families for every live worker (one
    with a live gauge's file in PROMETHEUS_MULTIPROC_DIR, which it removes as it stops) and for
    their parent (the supervisor), a `pid` label each. Read from /proc at scrape time; a worker
    killed without removing its files has no /proc left and is skipped."""

    def collect(self) -> Iterable[Metric]:
        path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
        pids = {int(m.group(1)) for f in glob.glob(os.path.join(path, "gauge_live*_*.db"))
                if (m := _LIVE_FILE.search(os.path.basename(f)))}
        pids.add(os.getppid())
        families: dict[str, Metric] = {}
        for pid in sorted(pids):
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "pid": str(pid)}, sample.value)
        return list(families.values())
