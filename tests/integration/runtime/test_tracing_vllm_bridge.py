"""Issue 30, vLLM's own request tracing bridged: with ``telemetry.tracing`` on, the engine the config
builds starts vLLM with ``otlp_traces_endpoint`` (OTLP/HTTP) and each request hands vLLM the request
span's W3C context, so the real Jaeger (tests/jaeger_proc.py) stores vLLM's ``llm_request`` span in
the request's trace, under ``zerolayer.request``. The runtime's own spans are proved in
test_observability_vllm.py; here only the bridge is.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any, AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, chat_body, start_runtime

from tests.jaeger_proc import Jaeger
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="vLLM's tracing imports the gRPC exporter too")

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]

REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bridged(tmp_path_factory) -> AsyncIterator[tuple[Any, Jaeger]]:
    from zerolayer.runtime.compose import build_tracer
    from zerolayer.runtime.config import build_engine, parse_config
    from zerolayer.runtime.node import tinymodel

    path = await asyncio.to_thread(tinymodel.generate, REPO / ".models" / MODEL)
    with Jaeger(tmp_path_factory.mktemp("jaeger")) as jaeger:
        config = parse_config({
            "engine": {"kind": "vllm", "model_path": str(path), "served_name": MODEL, "max_model_len": 512,
                       "max_num_seqs": 2, "kv_cache_memory_bytes": 32 * 1024 * 1024, "enforce_eager": True,
                       "dtype": "float32"},
            "telemetry": {"tracing": {"otlp_endpoint": jaeger.endpoint, "service_name": "zerolayer-bridge-test"}},
        }, REPO)
        engine = build_engine(config)
        assert engine.settings.otlp_traces_endpoint == jaeger.endpoint  # the composition root's wiring
        tracer = build_tracer(config.tracing)
        try:
            async with start_runtime(engine=engine, tracer=tracer) as server:
                yield server, jaeger
        finally:
            tracer.close()


async def test_vllms_request_span_lands_under_the_runtimes_request_span(bridged):
    import httpx

    server, jaeger = bridged
    parent = "b7ad6b7169203331"
    headers = {"x-api-key": KEY, "content-type": "application/json", "traceparent": f"00-{TRACE_ID}-{parent}-01"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        response = await client.post("/v1/messages", content=chat_body(stream=False, max_tokens=8, model=MODEL),
                                     headers=headers)
    assert response.status_code == 200, response.text
    spans = await asyncio.to_thread(jaeger.trace, TRACE_ID, 7)
    by_name = {s.name: s for s in spans}
    assert {"zerolayer.request", "gate", "admission", "queue", "prefill", "decode", "llm_request"} <= set(by_name)
    root, vllm = by_name["zerolayer.request"], by_name["llm_request"]
    assert root.parent_span_id == parent
    assert vllm.parent_span_id == root.span_id  # vLLM's span is a child of ours, in the client's trace
    assert vllm.service == "vllm" and root.service == "zerolayer-bridge-test"  # vLLM's own exporter, not ours
    assert 1 <= vllm.attributes["gen_ai.usage.completion_tokens"] <= 8
    assert vllm.attributes["gen_ai.request.id"]  # vLLM's id for the request
    assert root.start_ns <= vllm.start_ns <= vllm.end_ns <= root.end_ns + 5_000_000  # clocks: time.time vs ours
    print("\n" + "\n".join(f"{s.name:18} {s.service:22} parent={s.parent_span_id or '-':16} {s.duration_ms:9.3f} ms"
                           for s in sorted(spans, key=lambda s: s.start_ns)))
    print({k: v for k, v in vllm.attributes.items() if not k.startswith("@jaeger")})
