"""Issue 30: the SDK carries its caller's OpenTelemetry context, and the runtime's spans join it
(a real Jaeger v2 built from Go modules, tests/jaeger_proc.py; the synthetic engine, so no ``queue`` span:
it does not say when it scheduled a request). The vLLM case is test_observability_vllm.py."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, start_runtime

from tests.jaeger_proc import Jaeger

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session")
async def traced(tmp_path_factory) -> AsyncIterator[tuple[Any, Jaeger]]:
    from zerolayer.runtime.serving.tracing import OtlpTracer

    with Jaeger(tmp_path_factory.mktemp("jaeger")) as receiver:
        tracer = OtlpTracer(receiver.endpoint, "zerolayer-runtime")
        try:
            async with start_runtime(tracer=tracer) as server:
                yield server, receiver
        finally:
            tracer.close()


async def test_the_sdk_propagates_its_callers_span_and_the_runtime_joins_it(traced):
    import httpx
    from opentelemetry.sdk.trace import TracerProvider

    from zerolayer.client import AsyncClient

    server, receiver = traced
    caller = TracerProvider().get_tracer("caller")
    async with AsyncClient(api_key=KEY, base_url=server.base_url) as client:
        with caller.start_as_current_span("handle-user-request") as span:
            await client.messages.create(model="synthetic", max_tokens=8,
                                         messages=[{"role": "user", "content": "hello"}])
        context = span.get_span_context()
        untraced = await client.messages.create(model="synthetic", max_tokens=8,
                                                messages=[{"role": "user", "content": "hello"}])
    assert untraced.usage.output_tokens == 8
    async with httpx.AsyncClient(base_url=server.base_url) as http:  # answers name their span too
        answered = await http.post("/v1/messages", headers={"x-api-key": KEY}, json={
            "model": "synthetic", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    _, answered_trace, answered_span, _ = answered.headers["traceresponse"].split("-")
    trace_id = format(context.trace_id, "032x")
    spans = {s.name: s for s in await asyncio.to_thread(receiver.trace, trace_id, 5)}
    assert set(spans) == {"zerolayer.request", "gate", "admission", "prefill", "decode"}
    assert spans["zerolayer.request"].parent_span_id == format(context.span_id, "016x")
    assert spans["zerolayer.request"].attributes["gen_ai.usage.output_tokens"] == 8
    # a request made outside any span starts a trace of its own, the one its answer names
    roots = [s for s in await asyncio.to_thread(receiver.trace, answered_trace, 5)
             if s.name == "zerolayer.request"]
    assert [r.span_id for r in roots] == [answered_span] and roots[0].parent_span_id == ""


async def test_a_refused_request_is_traced_with_its_error_code(traced):
    import httpx

    server, receiver = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        response = await http.post("/v1/messages", headers={
            "x-api-key": KEY, "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
            json={"model": "no-such-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    assert response.json()["error"]["trace_id"] == trace_id  # the body names it too
    spans = {s.name: s for s in await asyncio.to_thread(receiver.trace, trace_id, 2)}
    # the error names the request's span, so a client can find the trace of what it was refused
    assert response.headers["traceresponse"] == f"00-{trace_id}-{spans['zerolayer.request'].span_id}-01"
    assert spans["zerolayer.request"].attributes["error.type"] == "MODEL_UNAVAILABLE"
    assert "prefill" not in spans


async def test_an_error_body_names_the_trace_the_runtime_started(traced):
    import httpx

    server, _ = traced
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        response = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    _, trace_id, _, _ = response.headers["traceresponse"].split("-")
    assert response.json()["error"]["trace_id"] == trace_id and response.json()["error"]["code"] == "MODEL_UNAVAILABLE"


async def test_untraced_errors_name_the_clients_trace_only():
    """Tracing off: a refusal (here at the headers, a wrong key) names the trace the client sent, if any."""
    import httpx

    trace_id = "0af7651916cd43dd8448eb211c80319d"
    async with start_runtime() as server, httpx.AsyncClient(base_url=server.base_url) as http:
        with_context = await http.post("/v1/messages", headers={
            "x-api-key": "wrong", "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}, json={})
        without = await http.post("/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert with_context.status_code == without.status_code == 401
    assert with_context.json()["error"]["trace_id"] == trace_id
    assert "trace_id" not in without.json()["error"] and "traceresponse" not in with_context.headers
