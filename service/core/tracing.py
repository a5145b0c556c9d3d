"""OpenTelemetry traces of the inference requests, off unless OpenTelemetry's own variables turn them on.

    read_environment()  what OTEL_* asks for (None: off); TracingError, one line, for a value it cannot use
    setup(), shutdown() the SDK's provider, a BatchSpanProcessor and the OTLP exporter, once a process
    begin()             a request's span (service.core.exchange.serve), the caller's W3C context continued

`on` is the request path's one check: while it is False nothing here is called and no span object is made.
A request's stages are stamped as they pass (floats on its `RequestTrace`) and become spans when it ends,
with the times they had; the batch run is one span of its own, linked to every request it served, and
each request's trace holds its share of it (`ran`). Spans leave through the BatchSpanProcessor's thread:
a receiver that is down, slow or refusing costs a request nothing, and what it loses is counted
(attend_trace_spans_dropped_total). docs/observability.md says which variables, spans and attributes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.core.logs import trace_ids
from service.core.otel import SDK, Config, TracingError, read_environment  # noqa: F401  (named here too)

if TYPE_CHECKING:
    from service.core.jobs import Job
    from service.core.metrics import Metrics
    from service.core.runtime import LoadedModel
    from service.core.tracesettings import TraceSettings

log = logging.getLogger("service")

on = False  # tracing is set up in this process (setup); read once per request and per batch


_TRACEPARENT = b"traceparent"  # an HTTP header's key (gRPC metadata's is str)
# How long the stop waits for the spans still queued to leave (a receiver that is down must not hold it).
_FLUSH_S = 5.0


_tracing: SDK | None = None
_users = 0  # the dataplanes of this process that set it up (shut down when the last one closes)


def setup(metrics: Metrics, environ: Mapping[str, str] | None = None) -> bool:
    """Tracing as the environment asks, for this process (its first dataplane's metrics count the spans
    lost). False: off. Raises TracingError for a value it cannot use."""
    global _tracing, _users, on
    config = read_environment(environ)
    if config is None:
        return False
    if _tracing is None:
        _tracing = SDK(config, metrics)
        on = True
        sampled = config.sampler + (f" {config.ratio:g}" if config.ratio is not None else "")
        log.info("tracing: %s to %s (%s), sampler %s, service.name %s", "+".join(config.exporters),
                 config.endpoint or "the default endpoint", config.protocol, sampled,
                 _tracing.resource.attributes.get("service.name"))
    _users += 1
    return True


def shutdown() -> None:
    """The last user gone: the spans still queued are sent, for `_FLUSH_S` at most (a receiver that is
    down must not hold the stop); then what is left is dropped and counted."""
    global _tracing, _users, on
    if _tracing is None:
        return
    _users -= 1
    if _users > 0:
        return
    tracing, _tracing, on = _tracing, None, False
    stopper = threading.Thread(target=tracing.shutdown, name="otel-shutdown", daemon=True)
    stopper.start()
    stopper.join(_FLUSH_S)
    if stopper.is_alive():
        for processor in tracing.processors:
            processor.span_exporter.shutdown()


# --------------------------------------------------------------------------------------- a request


def _now_ns() -> tuple[int, float, float]:
    """(epoch ns, perf_counter, monotonic) read together: the stamps' clocks turned into the spans'."""
    return time.time_ns(), time.perf_counter(), time.monotonic()


class RequestTrace:
    """One request's span and the stamps of its stages (perf_counter, but `job.enqueued` and `dequeued`:
    monotonic), turned into spans by `end`. `recording`: sampled, its stages are kept; else only its ids
    go out (the header, the log)."""

    __slots__ = ("span", "context", "recording", "token", "header", "ids", "error", "read", "body_bytes",
                 "decode", "where", "form", "job", "dequeued", "batch", "encoded", "write")

    def __init__(self, span: Any, context: Any, header: str, ids: str, recording: bool):
        self.span = span
        self.context = context
        self.header = header  # W3C traceresponse: version-trace_id-span_id-flags
        self.ids = ids  # what the log lines carry
        self.recording = recording
        self.token: Any = None
        self.error: Any = None  # the ServiceError the request ended with
        self.read: tuple[float, float] | None = None  # the body: (start, end or 0.0 where it failed)
        self.body_bytes = 0
        self.decode: tuple[float, float] | None = None
        self.where = "inline"
        self.form = ""
        self.job: Job | None = None
        self.dequeued = 0.0  # monotonic: when its batch took it
        self.batch: tuple[Any, int, int, int, int] | None = None  # (span context, start ns, end ns, requests, rows)
        self.encoded: tuple[float, float] | None = None
        self.write: tuple[float, float] | None = None

    def encoder(self, encode: Any) -> Any:
        """`encode`, its time kept (it runs inside the batch's run, on whichever thread runs it)."""
        def timed(model: Any, outputs: Any, weights: bool) -> Any:
            begun = time.perf_counter()
            answer = encode(model, outputs, weights)
            self.encoded = (begun, time.perf_counter())
            return answer

        return timed


def begin(x: Any, settings: TraceSettings) -> RequestTrace:
    """The request span of exchange `x`, child of the caller's traceparent where it sent one, and the
    trace's ids where the caller reads them (`x.traced`) and in its log lines. Sampled only where the trace
    settings offer it to the sampler and the sampler takes it."""
    tracing = _tracing
    assert tracing is not None
    parent = tracing.propagator.extract(x.headers, getter=tracing.getter) if _TRACEPARENT in x.headers \
        or "traceparent" in x.headers else None
    name, attributes, form = x.span_start()
    arrived = x.arrived
    start = None
    if arrived is not None:
        epoch, _, mono = _now_ns()
        start = epoch - int((mono - arrived) * 1e9)
    model = x.target[0]
    offered = settings.take(model)
    span = (tracing.tracer if offered else tracing.skip_tracer).start_span(
        name, context=parent, kind=tracing.SpanKind.SERVER, attributes=attributes, start_time=start)
    sc = span.get_span_context()
    trace_id, span_id = f"{sc.trace_id:032x}", f"{sc.span_id:016x}"
    recording = span.is_recording()
    if offered and not recording:
        settings.give_back(model)  # its count is for traces kept
    trace = RequestTrace(span, tracing.in_context(span) if recording else None,
                         f"00-{trace_id}-{span_id}-{'01' if sc.trace_flags.sampled else '00'}",
                         f"trace_id={trace_id} span_id={span_id}", recording)
    trace.form = form
    trace.token = trace_ids.set(trace.ids)
    x.traced(trace.header)
    return trace


def end(trace: RequestTrace, x: Any, status: int) -> None:
    """The request's stages as spans, then its span, with its status (0: the client went away, 499)."""
    trace_ids.reset(trace.token)
    span = trace.span
    error = trace.error
    if not trace.recording:
        span.end()
        return
    tracing = _tracing
    if tracing is None:  # stopped meanwhile
        span.end()
        return
    epoch, perf, mono = _now_ns()

    def ns(t: float, clock: float = perf) -> int:
        return epoch - int((clock - t) * 1e9)

    now = epoch
    context, tracer = trace.context, tracing.tracer
    failure = None if error is None else tracing.Status(tracing.StatusCode.ERROR, error.code)

    def child(name: str, stamps: tuple[float, float], attributes: dict | None = None, clock: float = perf) -> Any:
        begun, ended = stamps
        s = tracer.start_span(name, context=context, attributes=attributes, start_time=ns(begun, clock))
        if not ended and failure is not None:
            s.set_status(failure)
        s.end(end_time=ns(ended, clock) if ended else now)
        return s

    if trace.read is not None:
        child("read body", trace.read, {"attend.body.bytes": trace.body_bytes, "attend.body.form": trace.form})
    if trace.decode is not None:
        child("decode", trace.decode, {"attend.body.bytes": trace.body_bytes, "attend.body.form": trace.form,
                                       "attend.decode.where": trace.where})
    job = trace.job
    if job is not None:
        child("queue", (job.enqueued, trace.dequeued), None, mono)
    batch = trace.batch
    if batch is not None:  # its share of the run: the batch span's times, already in ns
        batch_context, begun_ns, ended_ns, requests, rows = batch
        share = tracer.start_span("infer", context=context, start_time=begun_ns, links=[tracing.Link(batch_context)],
                                  attributes={"attend.batch.requests": requests, "attend.batch.size": rows,
                                              "attend.request.rows": job.rows if job is not None else 0})
        share.end(end_time=ended_ns)
        if trace.encoded is not None:
            encoded = trace.encoded
            s = tracer.start_span("encode", context=tracing.in_context(share), start_time=ns(encoded[0]))
            s.end(end_time=ns(encoded[1]))
    if trace.write is not None:
        child("write", trace.write)
    attributes, is_error = x.span_end(status)
    if error is not None:
        attributes["error.type"] = error.code
        attributes["attend.error.message"] = error.message[:300]
    span.set_attributes(attributes)
    if is_error:
        span.set_status(tracing.Status(tracing.StatusCode.ERROR, error.code if error is not None else str(status)))
    span.end()


def dequeued(jobs: list[Job], at: float) -> None:
    """The batcher took `jobs` from the queue at `at` (monotonic)."""
    for job in jobs:
        trace = job.trace
        if trace is not None:
            trace.dequeued = at


def ran(model: LoadedModel, jobs: list[Job], begun: float, start: float, seconds: float, end: float) -> None:
    """A batch's run (perf_counter stamps: merge from `begun`, the session run from `start` for `seconds`,
    the slicing and encoding until `end`) as one span, linked to each traced request it served; each of
    them gets its share (`RequestTrace.batch`). Nothing where none of its requests is traced."""
    tracing = _tracing
    traces = [job.trace for job in jobs if job.trace is not None]
    if tracing is None or not traces:
        return
    epoch, perf, _ = _now_ns()

    def ns(t: float) -> int:
        return epoch - int((perf - t) * 1e9)

    rows = sum(job.rows for job in jobs)
    weights = any(job.request.return_weights for job in jobs)
    padded = padded_elements(model, jobs)
    graph, provider = graph_of(model, weights, sum(job.elements for job in jobs) + padded)
    attributes = {"attend.model.name": model.name, "attend.model.version": model.config.version,
                  "attend.execution_provider": provider, "attend.batch.size": rows,
                  "attend.batch.requests": len(jobs), "attend.batch.padded_elements": padded,
                  "attend.graph": graph, "attend.batch.weights": weights}
    links = [tracing.Link(t.span.get_span_context()) for t in traces]
    begun_ns, end_ns = ns(begun), ns(end)
    span = tracing.batch_tracer.start_span("batch run", attributes=attributes, links=links, start_time=begun_ns)
    run = tracing.batch_tracer.start_span("session run", context=tracing.in_context(span), start_time=ns(start),
                                          attributes={"attend.graph": attributes["attend.graph"]})
    run.end(end_time=ns(start + seconds))
    span.end(end_time=end_ns)
    share = (span.get_span_context(), begun_ns, end_ns, len(jobs), rows)
    for trace in traces:
        trace.batch = share


def graph_of(model: LoadedModel, weights: bool, elements: int) -> tuple[str, str]:
    """The graph file a batch of `elements` elements ran and its execution provider: the runtime's choice by
    size (LoadedModel.graph_for), asked again (a function of its arguments, as run_batch asked it)."""
    graph = model.graph_for(weights, elements)
    return graph.file, graph.provider


def padded_elements(model: LoadedModel, jobs: list[Job]) -> int:
    """The elements (inputs and outputs) the padding added: the merged run's less its requests' own."""
    if len(jobs) == 1:
        return 0
    from service.core.merge import product_sum, run_terms

    terms = model.derived.get("run terms")
    if terms is None:
        terms = model.derived["run terms"] = run_terms(model)
    batched, unbatched = terms
    shape = tuple(map(max, *(job.shape for job in jobs)))
    rows = sum(job.rows for job in jobs)
    return rows * product_sum(batched, shape) + product_sum(unbatched, shape) - sum(job.elements for job in jobs)
