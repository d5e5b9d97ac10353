"""Server glue over real sockets: failed GPU samples, the map endpoint read by the SDK, KV capacity."""

from __future__ import annotations

import asyncio
import json
from typing import Sequence

import httpx
import pytest

from runtime_helpers import KEY, H2Client, chat_body, sse_events, start_runtime

from zerolayer.client import nodes as client_nodes
from zerolayer.client.errors import ZerolayerError
from zerolayer.gpumap import FleetMap, render_map_document, utc_now_rfc3339
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gpu.api import GpuReading, GpuSourceError
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig
from zerolayer.runtime.scheduler.api import Pressure

pytestmark = pytest.mark.timeout(60)


class BrokenGpuSource:
    """Test double for a GPU whose driver stopped answering (no GPU here): every sample fails,
    either raising like NVML does or returning no reading at all."""

    kind = "simulated"

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.samples = 0

    def sample(self) -> Sequence[GpuReading]:
        self.samples += 1
        if self.raises:
            raise GpuSourceError("NVML: GPU is lost")
        return ()

    def close(self) -> None:
        pass


class CountingScheduler(MicroScheduler):
    """The real scheduler, counting ``observe`` calls."""

    observed = 0

    def observe(self, pressure: Pressure, now: float):  # type: ignore[override]
        self.observed += 1
        return super().observe(pressure, now)


@pytest.mark.parametrize("raises", [True, False], ids=["source-raises", "no-reading"])
async def test_failed_gpu_sample_skips_observe_but_still_enforces_deadlines(raises):
    gpu = BrokenGpuSource(raises)
    scheduler = CountingScheduler(SchedulerConfig())
    engine = SyntheticEngine(output_tokens=200, tokens_per_second=100)
    async with start_runtime(engine=engine, scheduler=scheduler, gpu_source=gpu, sample_interval_s=0.05) as server:
        async with H2Client(server.port) as client:
            sid = await client.request("/v1/messages", chat_body(),
                                       {"x-api-key": KEY, "x-anthropic-deadline-nanos": "300000000"})  # 300 ms
            result = client.streams[sid]
            await asyncio.wait_for(result.done.wait(), 10)
        name, data = sse_events(bytes(result.body))[-1]
        assert name == "error" and data["error"]["code"] == "DEADLINE_EXCEEDED"
        assert gpu.samples > 0 and scheduler.observed == 0 and server.last_pressure is None
        assert server.metrics.value("zerolayer_gpu_samples_failed_total") == gpu.samples
        assert b"zerolayer_gpu_samples_failed_total" in server.metrics.render()


def fleet() -> FleetMap:
    now = utc_now_rfc3339()
    return FleetMap.from_objects([
        {"metadata": {"name": name}, "status": {"endpoint": endpoint, "admitting": True, "lastHeartbeat": now,
                                                "load": {"running": 1, "waiting": 0, "kvCacheUsage": 0.25}}}
        for name, endpoint in (("a", "http://10.0.0.1:8080"), ("b", "http://10.0.0.2:8080"))])


async def test_sdk_node_map_parses_the_map_the_runtime_serves():
    snapshot = fleet()
    async with start_runtime(fleet=lambda: snapshot, self_name="a") as server:
        url = f"{server.base_url}/v1/zerolayer/map"
        async with httpx.AsyncClient(http1=False, http2=True) as http:
            anonymous = await http.get(url)
            answer = await http.get(url, headers={"x-api-key": KEY})
        assert anonymous.status_code == 401
        assert answer.status_code == 200 and answer.json() == json.loads(render_map_document(snapshot))
        # HttpNodeMap polls this same document; it parses it with nodes_from_document.
        nodes = client_nodes.nodes_from_document(answer.json())
        assert sorted((n.name, n.endpoint, n.admitting) for n in nodes) == [
            ("a", "http://10.0.0.1:8080", True), ("b", "http://10.0.0.2:8080", True)]
        # Without a tenant key the SDK's HttpNodeMap is refused, loudly; with one it reads the map.
        anonymous_map = client_nodes.HttpNodeMap(url, interval_s=3600)
        keyed_map = client_nodes.HttpNodeMap(url, api_key=KEY, interval_s=3600)
        try:
            with pytest.raises(ZerolayerError, match="401"):
                await asyncio.to_thread(anonymous_map.poll_once)
            polled = await asyncio.to_thread(keyed_map.poll_once)
            assert sorted(n.name for n in polled) == ["a", "b"]
        finally:
            anonymous_map.close()
            keyed_map.close()


async def test_map_endpoint_is_404_without_gossip():
    async with start_runtime() as server:
        async with httpx.AsyncClient(http1=False, http2=True) as http:
            answer = await http.get(f"{server.base_url}/v1/zerolayer/map", headers={"x-api-key": KEY})
        assert answer.status_code == 404 and answer.headers["x-zerolayer-error"] == "INVALID_REQUEST"


async def test_scheduler_projects_with_the_engines_kv_capacity_unless_configured():
    async with start_runtime(engine=SyntheticEngine(kv_capacity_tokens=12345)) as server:
        assert server.scheduler.config.kv_capacity_tokens == 12345
    configured = MicroScheduler(SchedulerConfig(kv_capacity_tokens=777))
    async with start_runtime(engine=SyntheticEngine(kv_capacity_tokens=12345), scheduler=configured) as server:
        assert server.scheduler.config.kv_capacity_tokens == 777
