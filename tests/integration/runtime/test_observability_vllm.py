"""Issue 30, the proof: a real Prometheus (Debian's) scrapes a runtime serving the real tiny vLLM and a
real auditor (journal mode), with the chart's PrometheusRule loaded as rendered by the real Helm.
Every dashboard panel query and every recorded signal and alert series returns data carrying the
labels the panel legend or the alert text uses; ``promtool check rules`` passes; the node stops
gossiping and ZerolayerNodeNotGossiping fires. The same runtime traces over OTLP: one request's spans,
under the client's trace id, are read back as a real Jaeger stored them (tests/jaeger_proc.py). The
operator's panels and rule are proved in tests/e2e/test_operator_scrape.py.

Gossip runs with its no-cluster sink (:class:`~zerolayer.runtime.gossip.PrintSink`): what is measured
is the runtime's own record of its heartbeats, the same whichever sink accepts them.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, AsyncIterator

import pytest
import pytest_asyncio
import yaml
from runtime_helpers import KEY, LIMITED_KEY, chat_body, start_runtime

from tests.dashboard_queries import queries
from tests.helm_render import helm_binary, monitoring_objects
from tests.jaeger_proc import Jaeger
from tests.prometheus_proc import Prometheus, free_port
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=420), pytest.mark.asyncio(loop_scope="session")]
if shutil.which("prometheus") is None or shutil.which("promtool") is None:
    pytestmark.append(pytest.mark.skip(reason="no prometheus/promtool: scripts/setup.sh installs Debian's "
                                              "prometheus package as root"))
if helm_binary() is None:
    pytestmark.append(pytest.mark.skip(reason="no Helm built yet: run scripts/setup.sh"))

REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
NAMESPACE, RELEASE = "zl-system", "zl"
JOB = f"{NAMESPACE}/{RELEASE}-zerolayer-runtime"  # what the chart's PodMonitor names its targets' job
POD = "zl-runtime-node-a"  # the PodMonitor's pod label, given here by static labels
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def chart() -> dict[str, Any]:
    """The chart's monitoring objects, with the gossip alert at hair trigger (0 s ``for``) for the test."""
    return monitoring_objects("metrics.alerts.nodeNotGossiping.for=0s", release=RELEASE, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def otlp(tmp_path_factory) -> Any:
    """A real Jaeger v2 (built from Go modules) receiving the runtime's OTLP/HTTP spans."""
    with Jaeger(tmp_path_factory.mktemp("jaeger")) as receiver:
        yield receiver


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def observed(chart, otlp, tmp_path_factory) -> AsyncIterator[dict[str, Any]]:
    """The runtime (vLLM, CPU source, journal metering, gossip, tracing), an auditor and Prometheus."""
    from prometheus_client import CollectorRegistry, generate_latest

    from zerolayer.bpf.probes import TokenProbe
    from zerolayer.runtime.engine.vllm_engine import VllmEngine
    from zerolayer.runtime.gossip import GossipPublisher, GossipSettings, Load, PrintSink, RecordingSource
    from zerolayer.runtime.gossip.metrics import GossipCollector
    from zerolayer.runtime.gpu.cpu import CpuSource
    from zerolayer.runtime.node import tinymodel
    from zerolayer.runtime.serving.tracing import OtlpTracer

    tmp = tmp_path_factory.mktemp("observability")
    spool = tmp / "spool"
    spool.mkdir()
    path = await asyncio.to_thread(tinymodel.generate, REPO / ".models" / MODEL)
    engine = VllmEngine(str(path), served_name=MODEL, max_model_len=1024, max_num_seqs=4,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32")
    gpus = RecordingSource(CpuSource(lambda: engine.stats().kv_cache_usage, kv_cache_bytes=64 * 1024 * 1024))
    holder: dict[str, GossipPublisher] = {}
    gossip = CollectorRegistry()
    gossip.register(GossipCollector(lambda: holder.get("publisher")))
    probe = TokenProbe(spool, journal=True, window_s=0.05)
    tracer = OtlpTracer(otlp.endpoint, "zerolayer-runtime-test")
    sink = open(os.devnull, "w")
    auditor_port = free_port()
    auditor_log = open(tmp / "auditor.log", "w")
    auditor = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli", "auditor", "--source", "journal", "--db", str(tmp / "audit.db"),
         "--spool", str(spool), "--flush-interval", "0.2", "--reconcile-interval", "1",
         "--metrics-port", str(auditor_port)], stdout=auditor_log, stderr=subprocess.STDOUT)
    prometheus = None
    try:
        async with start_runtime(engine=engine, gpu_source=gpus, sample_interval_s=0.1, token_sink=probe.emit,
                                 extra_metrics=[lambda: generate_latest(gossip)], tracer=tracer) as server:
            publisher = holder["publisher"] = GossipPublisher(
                "node-a", PrintSink(sink), readings=lambda: gpus.latest, load=lambda: Load(
                    server.engine.stats().running, server.engine.stats().waiting),
                settings=GossipSettings(heartbeat_s=1.0, stale_after_s=3.0), tick_s=0.2).start()
            rules = tmp / "rules.yaml"
            rules.write_text(yaml.safe_dump(chart["PrometheusRule"]["spec"]))
            prometheus = Prometheus(tmp, JOB, [f"127.0.0.1:{server.port}", f"127.0.0.1:{auditor_port}"],
                                    {"pod": POD, "namespace": f"{NAMESPACE}-runtime"}, rules)
            prometheus.wait("Prometheus ready", lambda: prometheus.query("up"))
            yield {"server": server, "prometheus": prometheus, "publisher": publisher, "rules": rules}
            publisher.stop(final=False)
    finally:
        if prometheus is not None:
            prometheus.stop()
        auditor.terminate()
        auditor.wait(timeout=30)
        auditor_log.close()
        tracer.close()
        probe.close()
        sink.close()


async def _traffic(base_url: str) -> None:
    """Answered requests for tenant acme (streamed and not) and one quota refusal for tenant limited."""
    import httpx

    headers = {"x-api-key": KEY, "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for stream in (True, False, True, False):
            response = await client.post("/v1/messages", content=chat_body(stream=stream, max_tokens=16, model=MODEL),
                                         headers=headers)
            assert response.status_code == 200, response.text
        limited = {**headers, "x-api-key": LIMITED_KEY}
        codes = [(await client.post("/v1/messages", content=chat_body(stream=False, max_tokens=4, model=MODEL),
                                    headers=limited)).status_code for _ in range(2)]
        assert codes == [200, 429]  # requests_per_minute=1


async def test_every_panel_and_alert_series_returns_data_and_the_gossip_alert_fires(observed, chart):
    prometheus, publisher = observed["prometheus"], observed["publisher"]
    await _traffic(observed["server"].base_url)
    promtool = subprocess.run(["promtool", "check", "rules", str(observed["rules"])], capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr

    runtime_side = [q for q in queries(chart) if not q.operator]  # the operator's: tests/e2e/test_operator_scrape.py
    assert len(runtime_side) > 20
    for query in runtime_side:
        series = await asyncio.to_thread(prometheus.wait, f"{query.what}: {query.expr}",
                                         lambda e=query.expr: prometheus.query(e))
        assert all(query.labels <= set(s["metric"]) for s in series), (query, series)

    def firing() -> list[dict[str, Any]]:
        return prometheus.firing("ZerolayerNodeNotGossiping")

    assert not firing()
    publisher.stop(final=False)  # what a hung runtime looks like: no more heartbeats
    (alert,) = await asyncio.to_thread(prometheus.wait, "ZerolayerNodeNotGossiping firing", firing)
    assert alert["labels"]["pod"] == POD and alert["labels"]["severity"] == "warning"


async def test_one_request_traced_under_the_clients_trace_id(observed, otlp):
    import httpx

    parent = "00f067aa0ba902b7"
    headers = {"x-api-key": KEY, "content-type": "application/json", "traceparent": f"00-{TRACE_ID}-{parent}-01"}
    async with httpx.AsyncClient(base_url=observed["server"].base_url, timeout=60) as client:
        response = await client.post("/v1/messages", content=chat_body(stream=True, max_tokens=24, model=MODEL),
                                     headers=headers)
    assert response.status_code == 200
    spans = {s.name: s for s in await asyncio.to_thread(otlp.trace, TRACE_ID, 6)}
    assert set(spans) == {"zerolayer.request", "gate", "admission", "queue", "prefill", "decode"}
    root = spans["zerolayer.request"]
    assert root.parent_span_id == parent and root.service == "zerolayer-runtime-test"
    assert root.attributes["zerolayer.tenant"] == "acme" and root.attributes["zerolayer.model"] == MODEL
    assert 1 <= root.attributes["gen_ai.usage.output_tokens"] <= 24
    order = ["gate", "admission", "queue", "prefill", "decode"]
    for name in order:
        assert spans[name].parent_span_id == root.span_id
        assert root.start_ns <= spans[name].start_ns <= spans[name].end_ns <= root.end_ns
    for earlier, later in zip(order, order[1:]):
        assert spans[earlier].end_ns <= spans[later].start_ns + 1000  # one after the other (ns rounding)
    print("\n" + "\n".join(f"{s.name:18} {s.duration_ms:9.3f} ms" for s in sorted(spans.values(),
                                                                                  key=lambda s: s.start_ns)))
