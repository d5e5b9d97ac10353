"""PressureFeed: simulated GPU samples -> scheduler on the event loop -> preemptions to the server."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_factories import admitted, running, scheduler, ticket
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.gpu import GpuSample, SimulatedGpuSource
from zerolayer.runtime.gpu.api import GpuSourceError
from zerolayer.runtime.scheduler.feed import PressureFeed

pytestmark = pytest.mark.timeout(30)
L, H = Priority.LOW, Priority.HIGH


def test_handle_builds_pressure_and_returns_preemptions():
    sched = scheduler(preempt_after_samples=1)
    source = SimulatedGpuSource({"gpus": [{"steps": [{"memory": 0.5, "samples": 1}, {"memory": 0.99, "samples": 1}]},
                                          {"steps": [{"memory": 0.1, "samples": 2}]}]})
    streams = admitted(sched, [running("big", L, 900), running("hi", H, 5), running("late", H, 5, deadline=0.0)])
    sent = []
    feed = PressureFeed(sched, source, running=lambda: (streams, 3), preempt=sent.append)
    first = feed.handle(GpuSample(source.sample(), time.monotonic()))
    assert [p.stream_key for p in first] == ["late"] and first[0].code is ErrorCode.DEADLINE_EXCEEDED
    second = feed.handle(GpuSample(source.sample(), time.monotonic()))  # fullest GPU (0.99) decides
    assert [(p.stream_key, p.code) for p in second] == [("big", ErrorCode.GPU_OOM)]
    assert sent == first + second
    assert not sched.admitting(L)


def test_failed_sample_keeps_the_gate_and_still_enforces_deadlines():
    sched = scheduler()
    streams = admitted(sched, [running("late", L, 1, deadline=0.0)])
    feed = PressureFeed(sched, SimulatedGpuSource.constant(0.99), running=lambda: ([], 0), preempt=lambda p: None)
    feed.handle(GpuSample(feed.source.sample(), time.monotonic()))
    assert not sched.admitting(L)
    feed._running = lambda: (streams, 0)
    out = feed.handle(GpuSample((), time.monotonic(), GpuSourceError("driver hiccup")))
    assert [p.reason for p in out] == ["deadline"]
    assert not sched.admitting(L)


async def test_feed_runs_on_the_loop_and_refuses_low_within_one_sample():
    sched = scheduler()
    source = SimulatedGpuSource.constant(0.5)
    seen: asyncio.Queue[GpuSample] = asyncio.Queue()
    feed = PressureFeed(sched, source, running=lambda: ([], 0), preempt=lambda p: None, interval_s=0.01,
                        on_sample=seen.put_nowait)
    feed.start()
    try:
        await asyncio.wait_for(seen.get(), 10)
        assert sched.admit(ticket(L), now=time.monotonic()).admitted
        source.set_memory(0.95)
        while (await asyncio.wait_for(seen.get(), 10)).memory_fraction < 0.95:
            pass
        # the sample that crossed has been observed: the very next low stream is refused
        refused = sched.admit(ticket(L), now=time.monotonic())
        assert refused.code is ErrorCode.RESOURCE_EXHAUSTED
    finally:
        await feed.stop()
    assert len(sched.metrics.reaction_samples) == 1


def test_an_empty_sample_is_not_zero_memory():
    from zerolayer.runtime.scheduler import SchedulerError, pressure_from_readings

    with pytest.raises(SchedulerError, match="keep the last pressure state"):
        pressure_from_readings((), (), 0, 1.0)
    readings = SimulatedGpuSource({"gpus": [{"steps": [{"memory": 0.4, "samples": 1}]},
                                           {"steps": [{"memory": 0.93, "samples": 1}]}]}).sample()
    assert pressure_from_readings(readings, (), 2, 1.0).memory_fraction == pytest.approx(0.93)
