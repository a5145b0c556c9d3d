"""OpenTelemetry's SDK as OTEL_* asks for it: the variables read and checked (`read_environment`), and the
provider, tracers, propagator and exporters of a process (`SDK`), its spans lost counted. service.core.tracing
sets it up and makes the spans."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from service.core.metrics import Metrics

log = logging.getLogger("service")

_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
_PROTOCOLS = ("grpc", "http/protobuf")
_EXPORTERS = ("otlp", "console", "none")


class TracingError(ValueError):
    """An OTEL_* variable the service cannot use; the message is one line naming it."""


@dataclass(frozen=True)
class Config:
    """What the environment asks for, checked."""

    exporters: tuple[str, ...]  # "otlp", "console"
    protocol: str  # "grpc" or "http/protobuf" (otlp's)
    endpoint: str | None  # as given (the exporter reads it again), for the start-up line
    sampler: str
    ratio: float | None  # the ratio samplers' argument


def _get(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def _number(environ: Mapping[str, str], name: str, kind: type = float, low: float = 0.0) -> None:
    value = _get(environ, name)
    if value is None:
        return
    try:
        number = kind(value)
    except ValueError:
        raise TracingError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(number) or number <= low:
        raise TracingError(f"{name}={value!r} must be over {low:g}")


def read_environment(environ: Mapping[str, str] | None = None) -> Config | None:
    """The tracing OTEL_* asks for, or None: off. On where an OTLP endpoint is set
    (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or OTEL_TRACES_EXPORTER names an
    exporter; off where OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. Raises TracingError for a
    value the SDK would only warn about and replace (a sampler, a ratio, a protocol, an endpoint)."""
    environ = os.environ if environ is None else environ
    if (_get(environ, "OTEL_SDK_DISABLED") or "").lower() == "true":
        return None
    endpoint = _get(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _get(environ, "OTEL_EXPORTER_OTLP_ENDPOINT")
    named = _get(environ, "OTEL_TRACES_EXPORTER")
    if named is None:
        if endpoint is None:
            return None
        exporters: tuple[str, ...] = ("otlp",)
    else:
        exporters = tuple(dict.fromkeys(e.strip().lower() for e in named.split(",") if e.strip()))
        unknown = [e for e in exporters if e not in _EXPORTERS]
        if unknown:
            raise TracingError(f"OTEL_TRACES_EXPORTER={named!r}: this service exports to {', '.join(_EXPORTERS)} "
                               f"(not {', '.join(unknown)})")
        if "none" in exporters:
            if len(exporters) > 1:
                raise TracingError(f"OTEL_TRACES_EXPORTER={named!r}: none cannot be listed with another exporter")
            return None
    protocol_name = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if _get(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                     else "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (_get(environ, protocol_name) or "grpc").lower()
    if protocol not in _PROTOCOLS:
        raise TracingError(f"{protocol_name}={protocol!r}: the OTLP exporters speak {' or '.join(_PROTOCOLS)}")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        value = _get(environ, name)
        if value is not None:
            url = urlparse(value)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise TracingError(f"{name}={value!r} is not a URL such as http://collector:4317 (grpc) or "
                                   "http://collector:4318 (http/protobuf)")
            try:
                url.port  # noqa: B018  (a port that is not a number raises here)
            except ValueError:
                raise TracingError(f"{name}={value!r}: its port is not a number") from None
    sampler = (_get(environ, "OTEL_TRACES_SAMPLER") or "parentbased_always_on").lower()
    if sampler not in _SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER={sampler!r}: one of {', '.join(_SAMPLERS)}")
    ratio = None
    if sampler.endswith("traceidratio"):
        arg = _get(environ, "OTEL_TRACES_SAMPLER_ARG")
        try:
            ratio = 1.0 if arg is None else float(arg)
        except ValueError:
            ratio = math.nan
        if not 0.0 <= ratio <= 1.0:
            raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: a ratio from 0 to 1 for {sampler}")
    attributes = _get(environ, "OTEL_RESOURCE_ATTRIBUTES")
    if attributes is not None:
        bad = [item for item in attributes.split(",") if item.strip() and "=" not in item]
        if bad:
            raise TracingError(f"OTEL_RESOURCE_ATTRIBUTES: {bad[0].strip()!r} is not key=value")
    for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
        _number(environ, name)
    for name in ("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        _number(environ, name, int)
    return Config(exporters, protocol, endpoint, sampler, ratio)


# ------------------------------------------------------------------------------------------- the SDK


class SDK:
    """The process's provider, its tracers and what counts the spans lost."""

    def __init__(self, config: Config, metrics: Metrics):
        from opentelemetry.propagators.textmap import Getter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # OTEL_SERVICE_NAME, else OTEL_RESOURCE_ATTRIBUTES' service.name, else "attend" (not the SDK's
        # "unknown_service:python").
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "attend"}))
        # Which process: with ATTEND_WORKERS each worker sets tracing up on its own.
        resource = Resource({"process.pid": os.getpid()}).merge(resource)
        self.config = config
        self.resource = resource
        # The sampler of OTEL_TRACES_SAMPLER(_ARG). Stopped by `shutdown`, bounded, not at exit (unbounded).
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        # A batch run is traced where one of its requests is, whatever the sampler said of a new trace.
        self.batch_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        self.processors = [_processor(name, config, metrics) for name in config.exporters]
        for processor in self.processors:
            self.provider.add_span_processor(processor)
            self.batch_provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("attend")
        self.batch_tracer = self.batch_provider.get_tracer("attend")
        # What the trace settings leave out (service.core.tracesettings): ids for its log lines, no span.
        self.skip_tracer = TracerProvider(resource=resource, sampler=ALWAYS_OFF, shutdown_on_exit=False
                                          ).get_tracer("attend")
        self.propagator = TraceContextTextMapPropagator()

        class _Headers(Getter):
            """HTTP headers (lower-case bytes) and gRPC metadata (str) alike."""

            def get(self, carrier: Mapping, key: str) -> list[str] | None:
                value = carrier.get(key)
                if value is None:
                    value = carrier.get(key.encode())
                if value is None:
                    return None
                return [value.decode("latin-1") if isinstance(value, bytes) else value]

            def keys(self, carrier: Mapping) -> list[str]:
                return [k.decode("latin-1") if isinstance(k, bytes) else k for k in carrier]

        self.getter = _Headers()
        self.Link, self.SpanKind, self.Status, self.StatusCode = Link, SpanKind, Status, StatusCode
        self.in_context = set_span_in_context

    def shutdown(self) -> None:
        for processor in self.processors:
            processor.shutdown()


def _processor(name: str, config: Config, metrics: Metrics) -> Any:
    """A BatchSpanProcessor on exporter `name`, counting the spans it exports and those it drops."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

    if name == "console":
        exporter: Any = ConsoleSpanExporter()
    elif config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()

    class CountingExporter(SpanExporter):
        """The exporter, its spans counted: exported, or dropped where it failed (after its own retries)."""

        def __init__(self) -> None:
            self.exported = metrics.trace_spans_exported
            self.failed = metrics.trace_spans_dropped.labels("export_failed")
            self.stopping = threading.Event()  # the stop's flush ran out of time: what is left is dropped

        def export(self, spans: Any) -> Any:
            if self.stopping.is_set():
                self.failed.inc(len(spans))
                return SpanExportResult.FAILURE
            try:
                result = exporter.export(spans)
            except Exception:
                log.exception("exporting %d span(s) failed", len(spans))
                result = SpanExportResult.FAILURE
            (self.exported if result is SpanExportResult.SUCCESS else self.failed).inc(len(spans))
            return result

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            if not self.stopping.is_set():
                self.stopping.set()
                exporter.shutdown()  # the OTLP exporters' shutdown ends a back-off between retries too

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return exporter.force_flush(timeout_millis)

    class CountingProcessor(BatchSpanProcessor):
        """The SDK's BatchSpanProcessor, counting what its full queue drops (it only logs that, once in 20 s)."""

        def __init__(self) -> None:
            super().__init__(CountingExporter())
            self.full = metrics.trace_spans_dropped.labels("queue_full")
            batch = self._batch_processor  # the SDK's queue (a bounded deque) and its bound
            self._queue, self._max = batch._queue, batch._max_queue_size

        def on_end(self, span: Any) -> None:
            if span.context.trace_flags.sampled and len(self._queue) >= self._max:
                self.full.inc()  # the deque drops its oldest span to take this one
            super().on_end(span)

    return CountingProcessor()
