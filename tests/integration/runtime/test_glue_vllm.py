"""The real vLLM engine's glue: gpu-defragd's nudge leaves the prefix cache alone, KV capacity for the scheduler.

One engine for the module (~20 s on a CPU), serving the tiny generated model.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
from typing import AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, H2Client, start_runtime
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_runtime() -> AsyncIterator:
    from zerolayer.runtime.node import tinymodel
    from zerolayer.runtime.engine.vllm_engine import VllmEngine

    path = await asyncio.to_thread(tinymodel.generate, REPO / ".models" / MODEL)
    engine = VllmEngine(str(path), served_name=MODEL, max_model_len=1024, max_num_seqs=4,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32")
    async with start_runtime(engine=engine, sample_interval_s=0.05) as server:
        yield server


async def test_scheduler_adopts_vllms_kv_capacity(vllm_runtime):
    capacity = vllm_runtime.engine.kv_capacity_tokens
    cache = vllm_runtime.engine._llm.vllm_config.cache_config
    assert capacity == cache.num_gpu_blocks * cache.block_size > 0
    assert vllm_runtime.scheduler.config.kv_capacity_tokens == capacity


async def _chat(port: int, text: str) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                       "temperature": 0}).encode()
    async with H2Client(port) as client:
        sid = await client.request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
        await asyncio.wait_for(client.streams[sid].done.wait(), 60)
        assert client.streams[sid].status == 200, bytes(client.streams[sid].body)
        return json.loads(bytes(client.streams[sid].body))


async def test_sigusr1_leaves_vllms_prefix_cache_and_answers_intact(vllm_runtime):
    """vLLM counts idle prefix blocks as free KV cache already, so the nudge frees nothing there and
    must not throw away the prefix cache that prefix-aware routing sends requests here for."""
    from zerolayer.runtime.defrag.release import ReleaseOnSignal
    from zerolayer.runtime.engine.vllm_engine import NOTHING_TO_RELEASE

    text = "zero layer " * 100  # many 16-token blocks
    before = await _chat(vllm_runtime.port, text)
    served = vllm_runtime.engine.served_prefixes  # the runtime's record of them, gossiped for routing
    recorded = (len(served), served.digest().encode())
    assert recorded[0] > 0
    released: list[list[str]] = []
    done = asyncio.Event()

    def on_release(steps: list[str]) -> None:
        released.append(steps)
        done.set()

    # What the node agent installs around the server (zerolayer.runtime.node.agent).
    handler = ReleaseOnSignal(asyncio.get_running_loop(), vllm_runtime.engine, on_release=on_release).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        handler.remove()
    assert released[0][0] == f"engine.release_memory(freed 0 bytes: {NOTHING_TO_RELEASE})"
    after = await _chat(vllm_runtime.port, text)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # vLLM's prefix cache survived
    assert after["choices"][0]["message"] == before["choices"][0]["message"]  # greedy: the same answer
    assert (len(served), served.digest().encode()) == recorded  # the gossiped record too
    assert vllm_runtime.engine.ready()
