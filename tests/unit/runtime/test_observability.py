"""Issue 30: the series the chart's dashboard and alerts read, and the request spans, with no cluster.

The proof against a real Prometheus and a real OTLP receiver is
tests/integration/runtime/test_observability_vllm.py; these check each piece where it is made."""

from __future__ import annotations

import asyncio
import io

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from zerolayer.runtime.config import parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.gossip import GossipPublisher, GossipSettings, Load, PrintSink
from zerolayer.runtime.gossip.metrics import GossipCollector, heartbeat_seconds
from zerolayer.runtime.gpu.api import GpuReading
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.scheduler.api import Ticket
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.serving.tracing import OtlpTracer, Timeline
from zerolayer.contract import Priority

GPU = GpuReading("GPU-1", 0, "H100", 30 * 2**30, 80 * 2**30, 0.5)


def test_gpu_map_gauges_follow_the_last_sample():
    readings: list[GpuReading] = []
    metrics = RuntimeMetrics()
    metrics.watch_gpus(lambda: readings)
    assert metrics.value("zerolayer_gpu_memory_used_bytes", gpu="0", uuid="GPU-1") == 0
    readings.append(GPU)
    assert metrics.value("zerolayer_gpu_memory_used_bytes", gpu="0", uuid="GPU-1") == 30 * 2**30
    assert metrics.value("zerolayer_gpu_memory_total_bytes", gpu="0", uuid="GPU-1") == 80 * 2**30
    assert metrics.value("zerolayer_gpu_utilization_ratio", gpu="0", uuid="GPU-1") == 0.5


def test_gossip_series_exist_only_while_gossip_runs_and_carry_the_published_heartbeat():
    holder: dict[str, GossipPublisher] = {}
    registry = CollectorRegistry()
    registry.register(GossipCollector(lambda: holder.get("p")))
    assert generate_latest(registry) == b""  # no --node-name: no gossip series, so no stale-node alert
    publisher = holder["p"] = GossipPublisher("n", PrintSink(io.StringIO()), readings=lambda: (GPU,), load=Load,
                                              settings=GossipSettings(heartbeat_s=4.0, stale_after_s=12.0),
                                              wall=lambda: 1_700_000_000.5)
    publisher.step()
    assert registry.get_sample_value("zerolayer_gossip_patches_total", {"result": "ok"}) == 1
    assert registry.get_sample_value("zerolayer_gossip_heartbeat_seconds") == 4.0
    assert registry.get_sample_value("zerolayer_gossip_last_heartbeat_timestamp_seconds") == 1_700_000_000.5
    assert heartbeat_seconds("2026-12-02T11:50:00.123Z") == pytest.approx(1796212200.123)


def test_quota_refusals_name_the_tenant():
    scheduler = MicroScheduler(SchedulerConfig())
    scheduler.set_tenants({"t1": TenantPolicy("t1", requests_per_minute=1)})
    for n in range(2):
        scheduler.admit(Ticket(stream_key=f"s{n}", tenant="t1", priority=Priority.NORMAL, model="m",
                               prompt_tokens=1, max_tokens=1, deadline=None, arrived=0.0), 0.0)
    assert scheduler.registry.get_sample_value("zerolayer_scheduler_quota_refused_total",
                                               {"tenant": "t1", "reason": "requests"}) == 1


def test_timeline_phases_split_queue_and_prefill_when_the_engine_says_when_it_scheduled():
    t = Timeline("00-" + "a" * 32 + "-" + "b" * 16 + "-01", arrived=1.0, gated=1.001, body=1.002, submitted=1.01,
                 scheduled=1.05, first_token=1.2, ended=2.0)
    assert t.phases() == [("gate", 1.0, 1.001), ("admission", 1.002, 1.01), ("queue", 1.01, 1.05),
                          ("prefill", 1.05, 1.2), ("decode", 1.2, 2.0)]
    t.scheduled = 0.0  # an engine that does not say: the wait for the first token is one prefill span
    assert [p[0] for p in t.phases()] == ["gate", "admission", "prefill", "decode"]
    refused = Timeline(None, arrived=1.0, gated=1.001, body=1.002)
    assert refused.phases() == [("gate", 1.0, 1.001)]


def test_spans_join_the_clients_trace():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    tracer = OtlpTracer("http://127.0.0.1:9/v1/traces", "svc", exporter=exported)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    tracer.emit(Timeline(f"00-{trace_id}-{parent}-01", 1.0, 1.001, 1.002, 1.01, 1.05, 1.2).close(
        2.0, **{"zerolayer.tenant": "acme", "error.type": None}))
    tracer.close()
    spans = {s.name: s for s in exported.get_finished_spans()}
    root = spans["zerolayer.request"]
    assert format(root.context.trace_id, "032x") == trace_id and format(root.parent.span_id, "016x") == parent
    assert dict(root.attributes) == {"zerolayer.tenant": "acme"}
    assert spans["decode"].end_time - spans["gate"].start_time == pytest.approx(1e9, abs=10)
    assert all(spans[n].parent.span_id == root.context.span_id for n in ("gate", "queue", "prefill", "decode"))


@pytest.mark.parametrize("tracing, error", [
    ({"otlp_endpoint": "collector:4318"}, r"an http\(s\) URL"),
    ({"otlp_endpoint": "http://c:4318/v1/traces", "sampler": "always"}, "unknown keys sampler"),
    ({"otlp_endpoint": "http://c:4318/v1/traces", "service_name": ""}, "service_name"),
])
def test_tracing_config_is_checked(tmp_path, tracing, error):
    with pytest.raises(ConfigError, match=error):
        parse_config({"telemetry": {"tracing": tracing}}, tmp_path)


def test_tracing_is_off_unless_an_endpoint_is_given(tmp_path):
    assert parse_config({}, tmp_path).tracing is None
    assert parse_config({"telemetry": {"tracing": {}}}, tmp_path).tracing is None
    on = parse_config({"telemetry": {"tracing": {"otlp_endpoint": "https://c:4318/v1/traces"}}}, tmp_path).tracing
    assert on is not None and on.service_name == "zerolayer-runtime"


def test_the_metrics_port_serves_what_the_serving_port_does(tmp_path):
    """--metrics-port answered the server's and scheduler's series only; gossip and energy were lost."""
    from zerolayer.runtime.compose import build_server, serve_metrics

    async def scrape() -> bytes:
        server = build_server(parse_config({"engine": {"kind": "synthetic"}}, tmp_path), port=0)
        server.app.extra_metrics = (*server.app.extra_metrics, lambda: b"zerolayer_test_extra 1\n")
        listener = await serve_metrics(server, 0, host="127.0.0.1")
        port = listener.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        body = await reader.read()
        writer.close()
        listener.close()
        return body

    body = asyncio.run(scrape())
    assert b"zerolayer_test_extra 1" in body and b"zerolayer_scheduler_admitting" in body
    assert b"zerolayer_time_per_output_token_seconds_bucket" in body


def test_the_request_span_ids_are_chosen_on_arrival_and_named_in_traceresponse():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    tracer = OtlpTracer("http://127.0.0.1:9/v1/traces", "svc", exporter=exported)
    joined = Timeline("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", 1.0, 1.1)
    fresh = Timeline(None, 1.0, 1.1)
    malformed = Timeline("00-" + "0" * 32 + "-00f067aa0ba902b7-01", 1.0, 1.1)  # all-zero trace id: invalid
    assert joined.traceresponse().startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert malformed.traceparent is None and malformed.trace_id != 0
    for timeline in (joined, fresh, malformed):
        tracer.emit(timeline.close(2.0))
    tracer.close()
    roots = [s for s in exported.get_finished_spans() if s.name == "zerolayer.request"]
    assert [f"00-{r.context.trace_id:032x}-{r.context.span_id:016x}-01" for r in roots] == [
        t.traceresponse() for t in (joined, fresh, malformed)]
    assert roots[1].parent is None and roots[2].parent is None
