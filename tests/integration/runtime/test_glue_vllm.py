"""The real vLLM engine's glue: memory release on gpu-defragd's nudge, KV capacity for the scheduler.

One engine for the module (~20 s on a CPU), serving the tiny generated model.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import start_runtime
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_runtime() -> AsyncIterator:
    from zerolayer.runtime import tinymodel
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


async def test_sigusr1_release_resets_vllms_prefix_cache(vllm_runtime):
    from zerolayer.runtime.defrag.release import release

    steps = await release(vllm_runtime.engine)  # what the SIGUSR1 handler runs
    assert steps[0] == "engine.release_memory"  # absent or failed, the step is not listed
    await vllm_runtime.engine.release_memory()  # and it raises EngineError if vLLM refuses
