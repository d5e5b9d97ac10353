"""Shedding and deadlines through the real runtime: HTTP/2 in, engine work out.

The GPU is simulated (``SimulatedGpuSource``, a scripted memory reading); the server, the
scheduler, the HTTP/2 stack and the synthetic engine are the real ones. Samples are taken by
calling ``RuntimeServer.sample_once()`` so "within one sample" is exact, not a race.
"""

from __future__ import annotations

import asyncio

import pytest

from scheduler_h2 import eventually, running_server, stream_messages, tenant, StreamResult
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gpu import SimulatedGpuSource
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MANUAL = 3600.0  # the server's own sampling loop sleeps; the test takes every sample itself


def preempted(sched: MicroScheduler, reason: str, priority: str, code: str) -> float:
    value = sched.registry.get_sample_value("zerolayer_scheduler_preempted_total",
                                            {"reason": reason, "priority": priority, "code": code})
    return value or 0.0


async def test_memory_climb_refuses_low_at_once_preempts_running_low_and_resumes_with_hysteresis():
    engine = SyntheticEngine(("synthetic",), output_tokens=2000, tokens_per_second=50)  # streams outlive the test
    source = SimulatedGpuSource.constant(0.5)
    sched = MicroScheduler(SchedulerConfig(preempt_after_samples=2, max_preemptions_per_tick=2))
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant()], gpu_source=source,
                              sample_interval_s=MANUAL) as (server, client):
        # three running low streams of different sizes and one high stream
        sizes = {"small": 2, "large": 300, "medium": 100}
        lows = {name: StreamResult() for name in sizes}
        tasks = [asyncio.create_task(stream_messages(client, "low", lows[n], words=w, max_tokens=2000))
                 for n, w in sizes.items()]
        high = StreamResult()
        tasks.append(asyncio.create_task(stream_messages(client, "high", high, max_tokens=2000)))
        for r in [*lows.values(), high]:
            await asyncio.wait_for(r.first_token.wait(), 20)
        assert engine.stats().running == 4

        # the sample that crosses 0.92: new low refused at once, nothing preempted yet
        source.set_memory(0.95)
        assert await server.sample_once() == []
        refused = await stream_messages(client, "low")
        assert refused.status == 529 and refused.error_code == "RESOURCE_EXHAUSTED"
        assert refused.headers["x-zerolayer-error"] == "RESOURCE_EXHAUSTED" and "retry-after" in refused.headers
        assert (await stream_messages(client, "normal", max_tokens=2)).completed  # normal is below its mark

        # pressure persists: the two largest running low streams are preempted (at most 2 per tick)
        preemptions = await server.sample_once()
        assert sorted(p.stream_key for p in preemptions) == sorted(
            s.key for s in server.app.streams.values() if s.preempted is not None)
        assert len(preemptions) == 2
        await eventually(lambda: lows["large"].total_s is not None and lows["medium"].total_s is not None,
                         what="preempted streams ending")
        for name in ("large", "medium"):
            assert lows[name].error_code == "GPU_OOM" and lows[name].reset, lows[name]
        await eventually(lambda: engine.stats().running == 2, what="engine work aborted")
        assert lows["small"].total_s is None and high.total_s is None  # still streaming

        # inside the hysteresis band: still refusing, no more preemption
        source.set_memory(0.90)
        assert await server.sample_once() == []
        assert (await stream_messages(client, "low")).status == 529
        # below the lower mark: admitted again
        source.set_memory(0.85)
        await server.sample_once()
        assert (await stream_messages(client, "low", max_tokens=3)).completed

        resets = sum(1 for r in lows.values() if r.reset)
        assert preempted(sched, "memory_pressure", "low", "GPU_OOM") == resets == 2
        assert preempted(sched, "memory_pressure", "high", "GPU_OOM") == 0
        assert len(sched.metrics.reaction_samples) == 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_high_streams_run_to_completion_under_any_pressure():
    engine = SyntheticEngine(("synthetic",), output_tokens=20, tokens_per_second=100)
    source = SimulatedGpuSource.constant(0.999)
    sched = MicroScheduler(SchedulerConfig(preempt_after_samples=1, max_preemptions_per_tick=10))
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant()], gpu_source=source,
                              sample_interval_s=MANUAL) as (server, client):
        await server.sample_once()
        task = asyncio.create_task(stream_messages(client, "high", max_tokens=20))
        for _ in range(5):
            await asyncio.sleep(0.03)
            assert await server.sample_once() == []
        result = await task
        assert result.completed
        assert (await stream_messages(client, "normal")).status == 529


async def test_deadline_expiry_aborts_engine_work():
    engine = SyntheticEngine(("synthetic",), output_tokens=1000, tokens_per_second=20)  # 50 s if left running
    sched = MicroScheduler()
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant()],
                              gpu_source=SimulatedGpuSource.constant(0.3), sample_interval_s=MANUAL) as (server, client):
        late = StreamResult()
        task = asyncio.create_task(stream_messages(client, "normal", late, max_tokens=1000,
                                                   **{"x-zerolayer-deadline-nanos": str(400_000_000)}))
        await asyncio.wait_for(late.first_token.wait(), 20)
        assert engine.stats().running == 1
        assert await server.sample_once() == []          # before the deadline: nothing to do
        await asyncio.sleep(0.5)                          # let the 400 ms budget run out
        preemptions = await server.sample_once()
        assert [(p.code.value, p.reason) for p in preemptions] == [("DEADLINE_EXCEEDED", "deadline")]
        await eventually(lambda: engine.stats().running == 0, what="engine request aborted")
        result = await task
        assert result.error_code == "DEADLINE_EXCEEDED" and result.reset
        assert preempted(sched, "deadline", "normal", "DEADLINE_EXCEEDED") == 1


async def test_unreachable_deadline_is_refused_before_any_engine_work():
    engine = SyntheticEngine(("synthetic",))
    sched = MicroScheduler(SchedulerConfig(min_first_token_s=0.05))
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant()],
                              sample_interval_s=MANUAL) as (server, client):
        result = await stream_messages(client, "high", **{"x-zerolayer-deadline-nanos": str(10_000_000)})
        assert result.status == 504 and result.error_code == "DEADLINE_EXCEEDED"
        assert server.app.engine_requests_started == 0


async def test_quota_refusal_carries_ratelimit_headers_over_http2():
    engine = SyntheticEngine(("synthetic",), output_tokens=4)
    sched = MicroScheduler()
    async with running_server(engine=engine, scheduler=sched,
                              tenants=[tenant(requests_per_minute=2, tokens_per_minute=10_000)],
                              sample_interval_s=MANUAL) as (server, client):
        first = await stream_messages(client, "normal", max_tokens=4)
        assert first.completed and first.headers["x-ratelimit-remaining-requests"] == "1"
        assert (await stream_messages(client, "normal", max_tokens=4)).completed
        refused = await stream_messages(client, "normal", max_tokens=4)
        assert refused.status == 429 and refused.error_code == "RATE_LIMITED"
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert 58 <= int(refused.headers["retry-after"]) <= 60  # the first request leaves the window in ~60 s


async def test_fifty_concurrent_streams_cannot_overshoot_the_token_quota():
    from bench.scheduler_h2load import H2LoadClient
    from scheduler_h2 import API_KEY, body
    import json

    from zerolayer.runtime.engine.base import ChatMessage

    # every stream lasts ~3 s, so none ends (and refunds its reservation) while the 50 are decided
    engine = SyntheticEngine(("synthetic",), output_tokens=4, tokens_per_second=1)
    limit = 500
    sched = MicroScheduler()
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant(tokens_per_minute=limit)],
                              sample_interval_s=MANUAL) as (server, client):
        prompt = await engine.render("synthetic", [ChatMessage("user", " ".join(["hello"] * 8))])
        per_request = prompt.token_count + 16  # reserved: prompt + max_tokens
        payload = json.dumps(body(8, 16)).encode()
        async with H2LoadClient("127.0.0.1", server.port) as h2c:
            results = await asyncio.gather(*(h2c.request("/v1/messages", {"x-api-key": API_KEY}, payload)
                                             for _ in range(50)))
        metrics = (await client.get("/metrics")).text
    ok = [r for r in results if r.status == 200]
    limited = [r for r in results if r.status == 429]
    assert len(ok) + len(limited) == 50
    # HEADERS-time reservations use a size estimate (content-length / 4), re-sized at body time,
    # so fewer than limit // per_request may get in, never more
    assert 0 < len(ok) <= limit // per_request
    assert all(r.error_code == "RATE_LIMITED" and int(r.headers["retry-after"]) >= 1 for r in limited)
    assert all(r.headers["x-ratelimit-limit-tokens"] == str(limit) for r in limited)
    # the scheduler's counters are served on the runtime's /metrics
    assert f'zerolayer_scheduler_refused_total{{code="RATE_LIMITED",priority="normal",reason="tokens"}} {len(limited)}.0' in metrics
