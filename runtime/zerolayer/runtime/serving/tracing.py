"""One request's OpenTelemetry spans, emitted once it has settled (docs/observability.md, "Traces").

Off by default: with no ``telemetry.tracing.otlp_endpoint`` the composition root passes no
tracer, a session keeps no :class:`Timeline` and the request path only tests ``is None``.

On, a session marks the moments of its life on the monotonic clock (:class:`Timeline`); when it
settles, :class:`OtlpTracer` turns them into spans with explicit start and end times, under the
client's W3C ``traceparent`` when it sent one (else a new trace):

``zerolayer.request`` (SERVER, the whole request) with children ``gate`` (headers: key, contract,
headers-stage admission), ``admission`` (body: parse, prompt, body-stage admission), ``queue``
(handed to the engine until the engine scheduled it), ``prefill`` (scheduled until the first
token) and ``decode`` (first token to the last). The engine says when it scheduled the request
(vLLM's ``scheduled_ts``, :attr:`~zerolayer.runtime.engine.base.Delta.scheduled_at`); an engine
that does not gives ``queue`` no span and ``prefill`` the whole wait for the first token.
Spans leave through the SDK's batch processor (a thread) to an OTLP/HTTP endpoint.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from typing import Any, Protocol

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def _new_id(bits: int) -> int:
    return random.getrandbits(bits) or 1  # all zeros is the invalid id


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) of a valid W3C ``traceparent``, else None: what an error body
    names when the request was not traced here but came with a context of its own."""
    parent = TRACEPARENT.match(traceparent or "")
    if parent is None or int(parent[1], 16) == 0 or int(parent[2], 16) == 0:
        return None
    return parent[1]


@dataclasses.dataclass
class Timeline:
    """Monotonic seconds of one request's moments (0.0: did not happen) and what to label it with.

    The request span's ids are chosen when the request arrives, so the answer can name them
    (``traceresponse``) before the span is built: the client's trace id when its ``traceparent`` is
    valid, else a new one."""

    traceparent: str | None
    arrived: float
    gated: float
    body: float = 0.0
    submitted: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    ended: float = 0.0
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    trace_id: int = 0
    span_id: int = 0

    def __post_init__(self) -> None:
        parent = trace_id_of(self.traceparent)
        if parent is None:
            self.traceparent = None  # malformed: a new trace, as the W3C spec asks
        self.trace_id = self.trace_id or (int(parent, 16) if parent else _new_id(128))
        self.span_id = self.span_id or _new_id(64)

    def traceresponse(self) -> str:
        """The W3C ``traceresponse`` header: this request's trace and span (sampled)."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"

    def close(self, ended: float, **attributes: Any) -> "Timeline":
        """Mark the end and add span attributes (None values left out); returns itself."""
        self.ended = ended
        self.attributes.update((k, v) for k, v in attributes.items() if v is not None)
        return self

    def phases(self) -> list[tuple[str, float, float]]:
        """``(name, start, end)`` of each child span that happened, in order."""
        out = [("gate", self.arrived, self.gated)]
        if self.body and self.submitted:
            out.append(("admission", self.body, self.submitted))
        if self.submitted:
            start_prefill = self.submitted
            if self.scheduled and self.scheduled >= self.submitted:
                out.append(("queue", self.submitted, self.scheduled))
                start_prefill = self.scheduled
            if self.first_token:
                out.append(("prefill", start_prefill, self.first_token))
                out.append(("decode", self.first_token, self.ended or self.first_token))
        return out


class Tracer(Protocol):
    """What a session hands its settled :class:`Timeline` to."""

    def emit(self, timeline: Timeline) -> None: ...


class OtlpTracer:
    """Spans over OTLP/HTTP (protobuf) to ``endpoint`` (``http://collector:4318/v1/traces``), batched by
    the OpenTelemetry SDK's own thread. Needs the ``tracing`` extra (``pip install zerolayer[tracing]``)."""

    def __init__(self, endpoint: str, service_name: str = "zerolayer-runtime", exporter: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._ids = _TimelineIds()
        # _TimelineIds has IdGenerator's three methods; it cannot subclass it (the SDK is imported only here)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       id_generator=self._ids)  # type: ignore[arg-type]
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self.provider.get_tracer("zerolayer.runtime")
        self._propagator = TraceContextTextMapPropagator()

    def emit(self, timeline: Timeline) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        offset = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> Unix nanoseconds

        def ns(moment: float) -> int:
            return int(moment * 1e9) + offset

        parent = self._propagator.extract({"traceparent": timeline.traceparent} if timeline.traceparent else {})
        end = timeline.ended or timeline.gated
        self._ids.preset(timeline.trace_id, timeline.span_id)  # the ids the answer named
        root = self._tracer.start_span("zerolayer.request", context=parent, kind=SpanKind.SERVER,
                                       start_time=ns(timeline.arrived), attributes=timeline.attributes)
        self._ids.preset(0, 0)  # a valid parent gave the trace id: the preset one is not left for the next span
        if "error.type" in timeline.attributes:
            root.set_status(Status(StatusCode.ERROR, str(timeline.attributes["error.type"])))
        inside = trace.set_span_in_context(root)
        for name, start, stop in timeline.phases():
            self._tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(stop))
        root.end(end_time=ns(end))

    def close(self) -> None:
        """Export what is queued, then stop the exporter thread."""
        self.provider.shutdown()


class _TimelineIds:
    """The SDK's id generator, told the request span's ids just before it is started (emit runs on
    one thread, the event loop); every other span gets random ids."""

    def __init__(self) -> None:
        self._trace_id = 0
        self._span_id = 0

    def preset(self, trace_id: int, span_id: int) -> None:
        self._trace_id, self._span_id = trace_id, span_id

    def generate_trace_id(self) -> int:
        trace_id, self._trace_id = self._trace_id, 0
        return trace_id or _new_id(128)

    def generate_span_id(self) -> int:
        span_id, self._span_id = self._span_id, 0
        return span_id or _new_id(64)

    def is_trace_id_random(self) -> bool:
        return True  # the ids it makes are random (a client's trace id comes with its own flags)
