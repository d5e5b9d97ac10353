"""The pressure signal on a GPU node under vLLM (issue 27).

vLLM pre-allocates ``gpu_memory_utilization`` of each GPU, so NVML's memory fraction is nearly
constant; the gate must follow the engine's KV-cache use there. The GPU is
``SimulatedGpuSource.under_vllm()`` (a double of what NVML reads under vLLM, behind the same
``GpuSource`` interface as ``NvmlSource``); the engine is the synthetic one with its KV-cache use
set by hand and, where it stands for vLLM, marked as pre-allocating. The server is the real one,
not started: ``sample_once()`` is the path its sampling loop takes.
"""

from __future__ import annotations

import asyncio

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.engine.base import EngineStats
from zerolayer.runtime.engine.router import ModelRouter
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gpu import GpuSourceError, SimulatedGpuSource
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, SchedulerConfigError
from zerolayer.runtime.scheduler.pressure import pressure_from_readings, resolve_pressure_signal
from zerolayer.runtime.serving.server import RuntimeServer


class KvEngine(SyntheticEngine):
    """The synthetic engine with its KV-cache use set by the test."""

    def __init__(self, *, preallocates: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.preallocates_gpu_memory = preallocates
        self.kv = 0.0

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, kv_cache_usage=self.kv)


def server(engine, source, **settings) -> RuntimeServer:
    return RuntimeServer(engine=engine, scheduler=MicroScheduler(SchedulerConfig.from_mapping(settings)),
                         gpu_source=source, port=0)


def low_admitted_after(srv: RuntimeServer, kv: float) -> bool:
    srv.engine.kv = kv
    asyncio.run(srv.sample_once())
    return srv.scheduler.admitting(Priority.LOW)


@pytest.mark.parametrize("allocated", [0.9, 0.93])  # just under and just over the 0.92 mark
def test_under_vllm_shedding_follows_the_kv_cache_not_the_preallocated_gpu_memory(allocated):
    srv = server(KvEngine(preallocates=True), SimulatedGpuSource.under_vllm(gpu_memory_utilization=allocated))
    assert srv.pressure_signal == "kvCache"
    assert low_admitted_after(srv, 0.10)  # before the fix: never admitted when 0.93 was pre-allocated
    assert srv.last_pressure.memory_fraction == pytest.approx(0.10)
    assert not low_admitted_after(srv, 0.95)  # before the fix: never shed when 0.9 was pre-allocated
    assert not low_admitted_after(srv, 0.90)  # hysteresis band
    assert low_admitted_after(srv, 0.50)


def test_gpu_memory_stays_the_signal_for_an_engine_that_does_not_preallocate():
    source = SimulatedGpuSource.under_vllm(gpu_memory_utilization=0.9)
    srv = server(KvEngine(preallocates=False), source)
    assert srv.pressure_signal == "gpuMemory"
    assert low_admitted_after(srv, 0.99)  # the KV cache is not read
    source.set_memory(0.95)
    assert not low_admitted_after(srv, 0.0)


@pytest.mark.parametrize("setting, preallocates, signal", [
    ("kvCache", False, "kvCache"), ("gpuMemory", True, "gpuMemory"), ("auto", True, "kvCache"),
])
def test_the_setting_overrides_auto(setting, preallocates, signal):
    srv = server(KvEngine(preallocates=preallocates), SimulatedGpuSource.under_vllm(), pressureSignal=setting)
    assert srv.pressure_signal == signal
    assert resolve_pressure_signal(setting, preallocates) == signal


def test_a_router_preallocates_when_any_engine_does():
    router = ModelRouter([SyntheticEngine(("a",)), KvEngine(preallocates=True, models=("b",))])
    assert router.preallocates_gpu_memory
    assert not ModelRouter([SyntheticEngine(("a",))]).preallocates_gpu_memory


def test_a_failed_gpu_sample_does_not_hide_the_kv_cache():
    source = SimulatedGpuSource({"name": "one", "at_end": "error", "gpus": [{"steps": [{"memory": 0.9, "samples": 1}]}]})
    srv = server(KvEngine(preallocates=True), source)
    assert low_admitted_after(srv, 0.1)
    assert not low_admitted_after(srv, 0.95)  # the scenario has ended: the GPU sample fails
    assert srv.failed_samples._value.get() == 1
    with pytest.raises(GpuSourceError):
        source.sample()


def test_kv_cache_pressure_needs_no_reading_and_is_clamped():
    assert pressure_from_readings((), (), 0, 1.0, kv_cache_usage=1.5).memory_fraction == 1.0
    with pytest.raises(SchedulerConfigError, match="pressure_signal"):
        SchedulerConfig.from_mapping({"pressureSignal": "nvml"})


def test_the_pressure_feed_reads_the_kv_cache_when_given_one():
    import time

    from zerolayer.runtime.gpu import GpuSample
    from zerolayer.runtime.scheduler.feed import PressureFeed

    kv = [0.1]
    sched = MicroScheduler()
    source = SimulatedGpuSource.under_vllm(gpu_memory_utilization=0.93)
    feed = PressureFeed(sched, source, running=lambda: ((), 0), preempt=lambda p: None, kv_cache_usage=lambda: kv[0])
    feed.handle(GpuSample(source.sample(), time.monotonic()))
    assert sched.admitting(Priority.LOW)  # 0.94 of GPU memory is vLLM's pre-allocation, not load
    kv[0] = 0.95
    feed.handle(GpuSample((), time.monotonic(), GpuSourceError("driver hiccup")))
    assert not sched.admitting(Priority.LOW)  # the KV cache does not depend on the GPU sample
