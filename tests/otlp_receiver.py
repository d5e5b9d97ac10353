"""An in-process OTLP/HTTP trace receiver for bench/tracing_cost.py: a real HTTP server that takes what an
OTLP exporter POSTs to ``/v1/traces`` and decodes it with opentelemetry-proto's protobuf classes, so the
bench pays the exporter's real work without needing Jaeger. The tracing tests use a real Jaeger built
from Go modules instead (tests/jaeger_proc.py)."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """Spans of one ExportTraceServiceRequest (protobuf, as the OTLP/HTTP exporter sends it)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                                        span.start_time_unix_nano, span.end_time_unix_nano,
                                        {a.key: _value(a.value) for a in span.attributes},
                                        str(resource.get("service.name", ""))))
    return out


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` listens on 127.0.0.1; ``receiver.endpoint`` is the traces URL."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str, count: int, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once ``count`` of them arrived (AssertionError after ``timeout``)."""
        stop = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if len(found) >= count or time.monotonic() > stop:
                assert len(found) >= count, f"{len(found)} of {count} spans of trace {trace_id}: {found}"
                return found
            time.sleep(0.05)
