"""Issue 30: the SDK sends the caller's current OpenTelemetry context (W3C traceparent) on every attempt."""

from __future__ import annotations

import pytest

from zerolayer.client.tracecontext import with_trace_context

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")


def test_no_span_no_header():
    assert with_trace_context({"x-extra": "1"}) == {"x-extra": "1"}


def test_the_current_span_goes_out_as_traceparent():
    from opentelemetry.sdk.trace import TracerProvider

    with TracerProvider().get_tracer("t").start_as_current_span("caller") as span:
        headers = with_trace_context({})
    context = span.get_span_context()
    assert headers["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def test_a_traceparent_the_caller_gives_wins():
    from opentelemetry.sdk.trace import TracerProvider

    mine = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with TracerProvider().get_tracer("t").start_as_current_span("caller"):
        assert with_trace_context({"Traceparent": mine}) == {"Traceparent": mine}
