"""Energy and cost per 1k tokens, per tenant and model, from GPU power and the streams being served.

On every GPU sample the node's power (the sum of ``power_watts`` over its GPUs) is integrated
over the time since the previous sample (trapezoid rule). That interval's energy is split
between the streams served in it in proportion to the tokens each processed in the interval
(prompt + generated, seen as the growth of its count between samples); an interval in which
streams were open but no token moved is split equally between them (prefill, queueing), and one
with no stream at all is the node's *idle* energy. Then, per tenant and model::

    energy_kwh        = joules / 3_600_000
    cost              = energy_kwh × electricity price per kWh   (spec.audit.electricityPricePerKWh)
    cost per 1k tokens = cost / tokens × 1000

(DESIGN.md §4 writes "W × s / 1000 × rate"; watt-seconds are joules, so the kWh conversion is
÷ 3.6e6, which is what is done here.) Resolution is the sample period (200 ms): tokens a stream
processes after the last sample before it ends are not seen. Sources without power readings
(the CPU source, scenarios without ``power_watts``) produce no energy.

Pure apart from the Prometheus counters; thread-safe (observed from the sampling thread, read
from the event loop).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from zerolayer.runtime.gpu.api import GpuReading

JOULES_PER_KWH = 3_600_000.0


@dataclasses.dataclass(frozen=True)
class StreamUse:
    """A stream as the meter sees it at one sample: cumulative tokens processed so far."""

    key: str
    tenant: str
    model: str
    tokens: int


@dataclasses.dataclass
class Usage:
    joules: float = 0.0
    tokens: int = 0

    def cost(self, price_per_kwh: float) -> float:
        return self.joules / JOULES_PER_KWH * price_per_kwh

    def cost_per_1k_tokens(self, price_per_kwh: float) -> float | None:
        return self.cost(price_per_kwh) / self.tokens * 1000 if self.tokens else None


class EnergyMeter:
    """Integrates power into per-(tenant, model) energy; exports ``zerolayer_energy_*`` metrics."""

    def __init__(self, *, price_per_kwh: float = 0.15, registry: CollectorRegistry | None = None) -> None:
        self.price_per_kwh = price_per_kwh
        self.registry = registry or CollectorRegistry()
        labels = ["tenant", "model"]
        self._joules = Counter("zerolayer_energy_joules", "GPU energy attributed to streams", labels,
                               registry=self.registry)
        self._tokens = Counter("zerolayer_energy_tokens", "Tokens the energy was attributed over", labels,
                               registry=self.registry)
        self._cost = Gauge("zerolayer_energy_cost", "Energy cost so far, in the electricity price's currency",
                           labels, registry=self.registry)
        self._per_1k = Gauge("zerolayer_energy_cost_per_1k_tokens", "Energy cost per 1000 tokens so far", labels,
                             registry=self.registry)
        self._idle = Counter("zerolayer_energy_idle_joules", "GPU energy with no stream open",
                             registry=self.registry)
        self._power = Gauge("zerolayer_gpu_power_watts", "GPU power at the last sample", ["gpu"],
                            registry=self.registry)
        self.usage: dict[tuple[str, str], Usage] = {}
        self.idle_joules = 0.0
        self._last: tuple[float, float] | None = None  # (at, node watts)
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, readings: Sequence[GpuReading], at: float, streams: Iterable[StreamUse]) -> float:
        """Account one sample taken at monotonic time ``at``; returns the joules of the interval it closes."""
        streams = list(streams)
        powers = [r.power_watts for r in readings if r.power_watts is not None]
        for r in readings:
            if r.power_watts is not None:
                self._power.labels(gpu=r.uuid).set(r.power_watts)
        with self._lock:
            deltas = {s.key: max(0, s.tokens - self._seen.get(s.key, 0)) for s in streams}
            self._seen = {s.key: s.tokens for s in streams}
            if not powers:
                self._last = None
                return 0.0
            watts = float(sum(powers))
            last, self._last = self._last, (at, watts)
            if last is None or at <= last[0]:
                return 0.0
            joules = (last[1] + watts) / 2 * (at - last[0])
            total = sum(deltas.values())
            if not streams:
                self.idle_joules += joules
                self._idle.inc(joules)
                return joules
            for s in streams:
                share = deltas[s.key] / total if total else 1 / len(streams)
                self._account(s.tenant, s.model, joules * share, deltas[s.key])
            return joules

    def _account(self, tenant: str, model: str, joules: float, tokens: int) -> None:
        usage = self.usage.setdefault((tenant, model), Usage())
        usage.joules += joules
        usage.tokens += tokens
        self._joules.labels(tenant=tenant, model=model).inc(joules)
        if tokens:
            self._tokens.labels(tenant=tenant, model=model).inc(tokens)
        self._cost.labels(tenant=tenant, model=model).set(usage.cost(self.price_per_kwh))
        per_1k = usage.cost_per_1k_tokens(self.price_per_kwh)
        if per_1k is not None:
            self._per_1k.labels(tenant=tenant, model=model).set(per_1k)
