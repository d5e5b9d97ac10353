"""Precise mode on the real engine: the gossiped prefix digest follows vLLM's own KV cache events
(``engine.prefix_digest: kv_events``), not the runtime's record of what it served.

One engine for the module (~20 s on a CPU), serving the tiny generated model; its KV blocks are 128
tokens on a CPU, so the chat is long enough to fill several.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from typing import AsyncIterator

import pytest
import pytest_asyncio
from runtime_helpers import KEY, H2Client, start_runtime
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=300), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = "tiny-llama"
SYSTEM = "zero layer " * 120  # ~600 tokens of the tiny tokenizer: 4 full KV blocks, 5 byte blocks


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_runtime() -> AsyncIterator:
    from zerolayer.runtime.engine.vllm_engine import VllmEngine
    from zerolayer.runtime.node import tinymodel

    path = await asyncio.to_thread(tinymodel.generate, REPO / ".models" / MODEL)
    engine = VllmEngine(str(path), served_name=MODEL, max_model_len=1024, max_num_seqs=4,
                        kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32",
                        prefix_digest="kv_events")
    async with start_runtime(engine=engine, sample_interval_s=0.05) as server:
        yield server


async def _chat(port: int, messages: list[dict]) -> dict:
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}).encode()
    async with H2Client(port) as client:
        sid = await client.request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
        await asyncio.wait_for(client.streams[sid].done.wait(), 60)
        assert client.streams[sid].status == 200, bytes(client.streams[sid].body)
        return json.loads(bytes(client.streams[sid].body))


async def _until(check, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_the_digest_holds_a_chat_once_vllm_stored_it_and_drops_it_after_a_reset(vllm_runtime):
    from zerolayer.engine_prefixes import EngineCachedPrefixes, byte_block_links
    from zerolayer.prefix import chat_block_hashes, prompt_bytes
    from zerolayer.runtime.engine.base import ChatMessage
    from zerolayer.runtime.gossip import prefix_cache_of

    engine = vllm_runtime.engine
    record = engine.served_prefixes
    assert isinstance(record, EngineCachedPrefixes)
    feed = engine._kv_events.feed
    turns = [("system", SYSTEM), ("user", "How much is it?")]
    blocks = chat_block_hashes(turns)

    # Rendered (what render_prompt records), not yet run: linked to its token blocks, held by no one.
    prompt = await engine.render(MODEL, [ChatMessage(role, text) for role, text in turns])
    record.observe_turns(turns, token_ids=prompt.token_ids)
    size = record.block_size
    assert size == engine._llm.vllm_config.cache_config.block_size
    expected = len(byte_block_links(len(prompt_bytes(turns)), prompt.token_count, size, prompt.token_count // size))
    assert 2 <= expected < len(blocks)  # the last byte block reaches the prompt's partial token block
    assert record.digest().matched(blocks) == 0 and feed.batches == 0

    # Served: vLLM stores the prompt's full blocks and says so; only then are its byte blocks held.
    await _chat(vllm_runtime.port, [{"role": r, "content": t} for r, t in turns])
    await _until(lambda: record.digest().matched(blocks) == expected, "BlockStored never reached the digest")
    assert feed.batches >= 1 and feed.gaps == 0 and record.unplaced == 0
    published = prefix_cache_of(engine)()
    assert published is not None and published["blocks"] >= expected

    # vLLM drops its prefix cache. Its AllBlocksCleared goes out with the engine's next step's events,
    # so the next request (one that shares nothing with the chat) carries it.
    assert await engine._llm.reset_prefix_cache()
    await _chat(vllm_runtime.port, [{"role": "user", "content": "hi"}])
    await _until(lambda: record.digest().matched(blocks) == 0, "the reset never reached the digest")
    assert prefix_cache_of(engine)()["blocks"] == 0

    # Served again: stored again, held again (the chat's links outlive the reset).
    again = await _chat(vllm_runtime.port, [{"role": r, "content": t} for r, t in turns])
    assert (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0  # the reset did drop it
    await _until(lambda: record.digest().matched(blocks) == expected, "the second store never reached the digest")


async def test_batches_the_subscriber_missed_come_back_from_vllms_own_replay_socket():
    """vLLM's real publisher (``ZmqEventPublisher``, no engine needed) configured as the runtime configures
    the engine core; the feed is handed only the third batch (as if the first two were dropped) and fetches
    the other two over vLLM's replay protocol, applying them first: every block is placed on its parent."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from zerolayer.engine_prefixes import EngineCachedPrefixes
    from zerolayer.runtime.engine.kv_events import KvEventSubscriber

    record = EngineCachedPrefixes(block_size=4)
    subscriber = KvEventSubscriber(record)  # not started: the test feeds it by hand
    config = subscriber.events_config()
    publisher = ZmqEventPublisher(0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"],
                                  buffer_steps=config["buffer_steps"], topic=config["topic"])
    try:
        for i in range(3):
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[100 + i], parent_block_hash=99 + i if i else None, token_ids=list(range(4 * i, 4 * i + 4)),
                block_size=4, lora_id=None, medium="GPU", lora_name=None)]))
        deadline = time.monotonic() + 20
        while len(replayed := subscriber.replay(0)) < 3:  # the publisher's thread buffers them as it sends
            assert time.monotonic() < deadline, f"vLLM's replay socket returned {len(replayed)} of 3 batches"
            time.sleep(0.05)
        assert [int.from_bytes(f[1], "big") for f in replayed] == [0, 1, 2]
        subscriber.feed.feed(replayed[2])
        assert subscriber.feed.replayed == 2 and subscriber.feed.batches == 3 and subscriber.feed.gaps == 0
        assert record.unplaced == 0  # 0 and 1 were applied before 2, whose parent is 1
    finally:
        publisher.shutdown()
        subscriber.stop()


async def test_vllms_publisher_binds_the_shared_ipc_endpoints_and_a_late_subscriber_replays(tmp_path):
    """Several API processes (docs/api-processes.md): the engine core gets ``shared_events_config``, and
    vLLM's real publisher *binds* its ``ipc://`` endpoints; a subscriber created after three batches went
    out connects, receives the next, replays the three it missed from vLLM's buffer and places all four."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from zerolayer.engine_prefixes import EngineCachedPrefixes
    from zerolayer.runtime.engine.kv_events import KvEventSubscriber, shared_events_config

    config = shared_events_config(str(tmp_path))
    publisher = ZmqEventPublisher(0, endpoint=config["endpoint"], replay_endpoint=config["replay_endpoint"],
                                  buffer_steps=config["buffer_steps"], topic=config["topic"])
    assert (tmp_path / "events").exists() and (tmp_path / "replay").exists()  # bound by vLLM, not connected

    def batch(i: int) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[100 + i], parent_block_hash=99 + i if i else None, token_ids=list(range(4 * i, 4 * i + 4)),
            block_size=4, lora_id=None, medium="GPU", lora_name=None)] if i < 4 else [])

    record = EngineCachedPrefixes(block_size=4)
    subscriber = None
    try:
        for i in range(3):
            publisher.publish(batch(i))
        probe = KvEventSubscriber(EngineCachedPrefixes(), publisher=config)  # not started: replays only
        deadline = time.monotonic() + 20
        while len(probe.replay(0)) < 3:  # vLLM's thread buffers each batch once it went out on the PUB
            assert time.monotonic() < deadline, "vLLM never sent the first 3 batches"
            await asyncio.sleep(0.05)
        probe.stop()
        subscriber = KvEventSubscriber(record, publisher=config)  # connects after 0-2 went out: never gets them
        subscriber.start()
        deadline, i = time.monotonic() + 20, 3
        while subscriber.feed.batches < 4:  # until the subscription arrived (later batches are empty)
            assert time.monotonic() < deadline, f"{subscriber.feed.batches} batches applied"
            publisher.publish(batch(i))
            i += 1
            await asyncio.sleep(0.1)
        assert subscriber.feed.replayed >= 3 and subscriber.feed.gaps == 0 and record.unplaced == 0
        assert len(record._engine) == 4  # every block placed on its parent
    finally:
        publisher.shutdown()
        if subscriber is not None:
            subscriber.stop()
