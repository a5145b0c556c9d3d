"""An OTLP trace receiver built on opentelemetry-proto's service definitions: gRPC's TraceService/Export and
HTTP's POST /v1/traces (protobuf, gzip or not), on loopback ports, keeping every span it is sent.

It receives what the SDK's own exporters send (no Collector installs here from PyPI or Debian), so the tests
check the spans as a real backend gets them. It can be told to answer slowly (`delay`) or to refuse (`refuse`:
PERMISSION_DENIED over gRPC, 400 over HTTP, neither of which an exporter retries).

    python -m tests.otlp [--grpc-port 4317] [--http-port 4318] [--print | --count-only]   one on the machine, until ^C
"""

from __future__ import annotations

import argparse
import gzip
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    """One span as the receiver got it: ids in hex, attributes as a dict."""

    name: str
    trace_id: str
    span_id: str
    parent: str  # the parent's span id, "" for a root
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: str
    message: str
    trace_state: str
    resource: dict[str, Any]
    scope: str
    via: str  # "grpc" or "http"
    events: list[str] = field(default_factory=list)


class Receiver:
    """OTLP over gRPC and HTTP on free loopback ports (`grpc_endpoint`, `http_endpoint`); `spans` as they come."""

    def __init__(self, delay: float = 0.0, refuse: bool = False, grpc_port: int = 0, http_port: int = 0,
                 keep: bool = True):
        self.delay = delay
        self.keep = keep  # False: spans counted (`count`), not kept (a benchmark's receiver)
        self.count = 0
        self.refuse = refuse
        self.spans: list[Span] = []
        self.requests = 0  # Export calls and POSTs received, refused ones too
        self.lock = threading.Lock()
        self.on_span: Callable[[Span], None] | None = None
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port, self.http_port = grpc_port, http_port  # 0: a free one

    # the protocol

    def _arrived(self) -> None:
        with self.lock:
            self.requests += 1

    def _take(self, request: pb.ExportTraceServiceRequest, via: str) -> None:
        if not self.keep:
            n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with self.lock:
                self.count += n
            return
        got = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent=s.parent_span_id.hex(),
                        kind=KINDS.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status=STATUS.get(s.status.code, str(s.status.code)), message=s.status.message,
                        trace_state=s.trace_state, resource=resource, scope=scope_spans.scope.name, via=via,
                        events=[e.name for e in s.events]))
        with self.lock:
            self.spans.extend(got)
            self.count += len(got)
        if self.on_span is not None:
            for span in got:
                self.on_span(span)

    def start(self) -> Receiver:
        receiver = self

        class Service(pb_grpc.TraceServiceServicer):
            def Export(self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext  # noqa: N802
                       ) -> pb.ExportTraceServiceResponse:
                receiver._arrived()
                if receiver.delay:
                    time.sleep(receiver.delay)
                if receiver.refuse:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, "this receiver refuses every span")
                receiver._take(request, "grpc")
                return pb.ExportTraceServiceResponse()

        server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_TraceServiceServicer_to_server(Service(), server)
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        server.start()
        self._grpc = server

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                receiver._arrived()
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if receiver.delay:
                    time.sleep(receiver.delay)
                if self.path != "/v1/traces" or receiver.refuse:
                    self.send_response(404 if self.path != "/v1/traces" else 400)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                request = pb.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request, "http")
                answer = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", self.http_port), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    # reading what came

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, found: Callable[[list[Span]], Any], timeout: float = 15.0) -> Any:
        """`found(spans)`'s first true value, asked again as spans come; AssertionError after `timeout`."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            result = found(spans)
            if result:
                return result
            if time.monotonic() > end:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"not received within {timeout} s; {len(spans)} spans came: {names}")
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-port", type=int, default=4317, help="0: a free one")
    parser.add_argument("--http-port", type=int, default=4318, help="0: a free one")
    parser.add_argument("--print", action="store_true", help="a line a span")
    parser.add_argument("--count-only", action="store_true", help="count the spans, keep none (a benchmark's)")
    args = parser.parse_args()
    receiver = Receiver(grpc_port=args.grpc_port, http_port=args.http_port, keep=not args.count_only).start()
    print(f"receiving OTLP: gRPC on {receiver.grpc_endpoint}, HTTP on {receiver.http_endpoint}/v1/traces", flush=True)
    if args.print:
        receiver.on_span = lambda s: print(f"{s.trace_id} {s.span_id} <- {s.parent or '-':16} {s.kind:8} {s.name} "
                                           f"{(s.end_ns - s.start_ns) / 1e3:.0f}us {s.attributes}", flush=True)
    try:
        while True:
            time.sleep(5)
            print(f"{receiver.count} spans in {receiver.requests} exports", flush=True)
    except KeyboardInterrupt:
        receiver.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
