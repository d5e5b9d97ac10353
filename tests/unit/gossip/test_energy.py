"""Energy per tenant and model: integration, attribution by tokens, idle energy, cost per 1k tokens."""

from __future__ import annotations

import pytest

from zerolayer.runtime.gossip.energy import EnergyMeter, StreamUse
from zerolayer.runtime.gpu.api import GpuReading


def gpus(*watts):
    return [GpuReading(uuid=f"G{i}", index=i, name="g", memory_used_bytes=1, memory_total_bytes=2, utilization=0.5,
                       power_watts=w) for i, w in enumerate(watts)]


def test_trapezoid_integration_split_by_tokens_processed():
    meter = EnergyMeter(price_per_kwh=0.36)
    meter.observe(gpus(300, 100), 0.0, [StreamUse("s1", "acme", "m", 0), StreamUse("s2", "beta", "m", 0)])
    # 1 s later: node went from 400 W to 600 W -> 500 J; s1 processed 30 tokens, s2 10
    joules = meter.observe(gpus(400, 200), 1.0, [StreamUse("s1", "acme", "m", 30), StreamUse("s2", "beta", "m", 10)])
    assert joules == pytest.approx(500.0)
    assert meter.usage[("acme", "m")].joules == pytest.approx(375.0)
    assert meter.usage[("beta", "m")].joules == pytest.approx(125.0)
    acme = meter.usage[("acme", "m")]
    # 375 J = 1.0417e-4 kWh; × 0.36 = 3.75e-5; per 1k tokens over 30 tokens = 1.25e-3
    assert acme.cost(0.36) == pytest.approx(3.75e-5)
    assert acme.cost_per_1k_tokens(0.36) == pytest.approx(1.25e-3)
    value = meter.registry.get_sample_value
    assert value("zerolayer_energy_joules_total", {"tenant": "acme", "model": "m"}) == pytest.approx(375.0)
    assert value("zerolayer_energy_tokens_total", {"tenant": "beta", "model": "m"}) == 10
    assert value("zerolayer_energy_cost_per_1k_tokens", {"tenant": "acme", "model": "m"}) == pytest.approx(1.25e-3)
    assert value("zerolayer_gpu_power_watts", {"gpu": "G1"}) == 200


def test_idle_energy_and_streams_without_tokens():
    meter = EnergyMeter()
    meter.observe(gpus(100), 0.0, [])
    meter.observe(gpus(100), 2.0, [])  # nobody: 200 J idle
    assert meter.idle_joules == pytest.approx(200.0)
    meter.observe(gpus(100), 3.0, [StreamUse("a", "t1", "m", 0), StreamUse("b", "t2", "m", 0)])  # prefill
    assert meter.usage[("t1", "m")].joules == pytest.approx(50.0) and meter.usage[("t1", "m")].tokens == 0
    assert meter.usage[("t1", "m")].cost_per_1k_tokens(0.15) is None


def test_no_power_no_energy_and_a_gap_restarts_the_integral():
    meter = EnergyMeter()
    assert meter.observe(gpus(None), 0.0, []) == 0.0
    assert meter.observe(gpus(100), 1.0, []) == 0.0  # first sample with power: nothing to integrate yet
    assert meter.observe(gpus(None), 2.0, []) == 0.0
    assert meter.observe(gpus(100), 3.0, []) == 0.0  # the powerless gap is not integrated
    assert meter.observe(gpus(100), 4.0, []) == pytest.approx(100.0)
