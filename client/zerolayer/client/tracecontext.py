"""The caller's trace context on every attempt: W3C ``traceparent`` (and ``tracestate``, baggage) from
the OpenTelemetry context current when a request is made, through the propagator the application
configured (``opentelemetry.propagate``; by default W3C Trace Context and Baggage).

Without the ``opentelemetry-api`` package, or outside any span, nothing is added. A ``traceparent``
the caller passes in ``extra_headers`` wins. The runtime joins its spans to this context
(docs/observability.md, "Traces").
"""

from __future__ import annotations

from typing import Callable, Mapping

_inject: Callable[[dict[str, str]], None] | None
try:
    from opentelemetry.propagate import inject as _inject
except ImportError:  # the SDK does not require OpenTelemetry
    _inject = None


def with_trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` plus the current context's propagation headers, unless ``headers`` carry one already."""
    out = dict(headers)
    if _inject is None or any(k.lower() == "traceparent" for k in out):
        return out
    carrier: dict[str, str] = {}
    _inject(carrier)
    return {**carrier, **out}
