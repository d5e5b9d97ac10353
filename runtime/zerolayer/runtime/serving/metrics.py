"""The runtime's Prometheus metrics, on one registry served at ``/metrics``.

Besides our own ``zerolayer_*`` series this exposes the gauges inference endpoint
pickers read from vLLM servers (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``), computed from the engine
at scrape time, so a node can sit behind a Gateway API Inference Extension pool.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from zerolayer.runtime.counting import PendingIncrements
from zerolayer.runtime.engine.base import EngineStats
from zerolayer.runtime.gpu.api import GpuReading
from zerolayer.runtime.limits import Limits


# Limits whose names do not start with the prefixes above, counted too (docs/security.md).
OTHER_LIMITS = ("header_timeout_s", "body_timeout_s", "write_timeout_s", "auth_failure_burst")


class _EngineCollector(Collector):
    """The gauges vLLM's own server exposes, one sample per base model (``model_name``), and
    ``vllm:lora_requests_info`` as vLLM writes it (value: the time of the reading; labels: the
    adapter slots and the adapters with running / waiting requests, comma-separated)."""

    def __init__(self, stats: Callable[[], Sequence[tuple[str, EngineStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        readings = self._stats()
        for name, doc, field in (
            ("vllm:num_requests_waiting", "Requests waiting in the engine queue.", "waiting"),
            ("vllm:num_requests_running", "Requests running in the engine.", "running"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.", "kv_cache_usage"),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            for model, stats in readings:
                family.add_metric([model], float(getattr(stats, field)))
            yield family
        lora = [(model, stats.lora) for model, stats in readings if stats.lora is not None]
        if lora:
            family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                       labels=["model_name", "max_lora", "waiting_lora_adapters",
                                               "running_lora_adapters"])
            now = time.time()
            for model, info in lora:
                family.add_metric([model, str(info.max_loras), ",".join(info.waiting), ",".join(info.running)], now)
            yield family


class _GpuMapCollector(Collector):
    """This node's GPU map as gauges, from the last GPU sample the server took (``readings()``):
    the same readings gossip publishes into ``InferenceNode.status``, one sample per GPU."""

    def __init__(self, readings: Callable[[], Sequence[GpuReading]]) -> None:
        self._readings = readings

    def collect(self) -> Iterable[GaugeMetricFamily]:
        readings = self._readings()
        for name, doc, value in (
            ("zerolayer_gpu_memory_used_bytes", "GPU memory in use at the last sample.",
             lambda g: g.memory_used_bytes),
            ("zerolayer_gpu_memory_total_bytes", "GPU memory in all.", lambda g: g.memory_total_bytes),
            ("zerolayer_gpu_utilization_ratio", "GPU compute utilisation over the last sample period, 0..1.",
             lambda g: g.utilization),
        ):
            family = GaugeMetricFamily(name, doc, labels=["gpu", "uuid"])
            for reading in readings:
                family.add_metric([str(reading.index), reading.uuid], float(value(reading)))
            yield family


#: 1 ms .. 1 s per output token (vLLM's own ``vllm:time_per_output_token_seconds`` range, trimmed).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class RuntimeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self._pending = PendingIncrements(r)  # before the counters it feeds (see counting.py)
        self.requests = Counter("zerolayer_requests", "Requests answered, by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.refusals = Counter("zerolayer_refusals", "Requests refused with a contract error before any output.",
                                ["code", "reason"], registry=r)
        self.preemptions = Counter("zerolayer_preemptions", "Running streams stopped by the scheduler.",
                                   ["code", "reason"], registry=r)
        self.limit_hits = Counter("zerolayer_h2_limit_hits", "Hardening limits tripped, by setting name.",
                                  ["limit"], registry=r)
        self.connections = Counter("zerolayer_connections", "Connections accepted, by protocol.",
                                   ["protocol"], registry=r)
        self.connections_active = Gauge("zerolayer_connections_active", "Open connections.", registry=r)
        self.streams_active = Gauge("zerolayer_streams_active", "Streams being served.", registry=r)
        self.tokens = Counter("zerolayer_tokens", "Tokens processed, by tenant and kind (prompt/completion).",
                              ["tenant", "kind"], registry=r)
        self.ttft = Histogram("zerolayer_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                              registry=r)
        self.tpot = Histogram("zerolayer_time_per_output_token_seconds",
                              "First output token to the last, over the output tokens after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.pings = Counter("zerolayer_h2_pings_sent", "Keep-alive PINGs sent on idle connections.", registry=r)
        self.idle_closed = Counter("zerolayer_idle_connections_closed", "Connections closed by the idle timeout.",
                                   registry=r)
        self.connections_aged = Counter(
            "zerolayer_connections_aged", "Connections past server.max_connection_age_s (stage=drain; an idle one drains "
            "at its next request) and those closed still open at the grace's end (stage=grace).", ["stage"], registry=r)
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._token_children: dict[tuple[str, str], Counter] = {}
        # Every limit appears at 0 from the start, so alerts can be written before the first hit.
        for name in Limits.__dataclass_fields__:
            if name.startswith(("max_", "rapid_", "empty_", "window_")) or name in OTHER_LIMITS:
                self.limit_hits.labels(name)

    # Label children cached by value: ``labels()`` takes a lock and builds a key on every call,
    # and these are counted on every request; their increments wait for the next read (counting.py).
    def count_request(self, route: str, status: int) -> None:
        child = self._request_children.get((route, status))
        if child is None:
            child = self._request_children[(route, status)] = self.requests.labels(route, str(status))
        self._pending.add(child)

    def count_tokens(self, tenant: str, kind: str, n: int) -> None:
        child = self._token_children.get((tenant, kind))
        if child is None:
            if len(self._token_children) > 4096:  # tenants come and go with config: keep it bounded
                self._token_children.clear()
            child = self._token_children[(tenant, kind)] = self.tokens.labels(tenant, kind)
        self._pending.add(child, n)

    def observe_ttft(self, seconds: float) -> None:
        self._pending.observe(self.ttft, seconds)  # applied at the next read of the registry (counting.py)

    def observe_tpot(self, seconds: float) -> None:
        self._pending.observe(self.tpot, seconds)

    def watch_engine(self, stats: Callable[[], Sequence[tuple[str, EngineStats]]]) -> None:
        """Collect the ``vllm:*`` gauges from ``stats`` (an engine's ``model_stats``) at scrape time."""
        self.registry.register(_EngineCollector(stats))

    def watch_gpus(self, readings: Callable[[], Sequence[GpuReading]]) -> None:
        """Collect the GPU map gauges (``zerolayer_gpu_*``) from ``readings()`` at scrape time."""
        self.registry.register(_GpuMapCollector(readings))

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0 when absent); for tests and the bench."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def render_registry(registry: CollectorRegistry) -> bytes:
        return generate_latest(registry)
