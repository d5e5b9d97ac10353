"""The prefix-cache digest in the gossip: what is published, how often, and from which engines."""

from __future__ import annotations

import asyncio

from zerolayer.prefix import PrefixDigest, ServedPrefixes, chat_block_hashes
from zerolayer.runtime.api.common import render_prompt
from zerolayer.runtime.engine.base import ChatMessage
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gossip import prefix_cache_of
from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load, build_status
from zerolayer.runtime.gpu.api import GpuReading

READING = GpuReading(uuid="GPU-0", index=0, name="g", memory_used_bytes=10, memory_total_bytes=100, utilization=0.1)
SYSTEM = "Answer as the fleet's billing desk. " * 40


def test_settings_read_the_digest_interval():
    assert GossipSettings.from_spec({"gossip": {"prefixDigestSeconds": 7}}).prefix_digest_s == 7
    assert GossipSettings().prefix_digest_s == 2.0


def test_status_carries_the_digest_only_when_there_is_one():
    plain = build_status([READING], {}, Load(), endpoint="http://n:1", heartbeat=0.0)
    assert "prefixCache" not in plain
    record = ServedPrefixes()
    record.observe_turns([("system", SYSTEM)])
    status = build_status([READING], {}, Load(), endpoint="http://n:1", heartbeat=0.0, prefix_cache=record.status())
    assert PrefixDigest.decode(status["prefixCache"]["digest"]).matched(chat_block_hashes([("system", SYSTEM)])) > 0


def test_a_new_digest_goes_out_at_most_once_per_interval():
    state = GossipState(GossipSettings(heartbeat_s=60, max_patches_per_s=100, prefix_digest_s=2.0), endpoint="e")
    record = ServedPrefixes()

    def tick(now):
        plan = state.plan([READING], Load(), now, now, prefix_cache=record.status())
        if plan is not None:
            state.published(plan, now)
        return plan and plan.reason

    assert tick(0.0) == "first"
    record.observe([1, 2])
    assert tick(0.5) is None  # the first publication counts as a digest publication
    assert tick(2.1) == "prefix-digest"
    record.observe([3])
    assert tick(2.5) is None and tick(3.0) is None
    assert tick(4.2) == "prefix-digest"
    assert tick(5.0) is None  # unchanged: nothing to send
    record.clear()  # gpu-defragd's reset: the emptied digest goes out like any change
    assert tick(6.3) == "prefix-digest"


def test_the_node_digest_is_the_union_of_its_engines():
    a, b = SyntheticEngine(("a",)), SyntheticEngine(("b",))
    a.served_prefixes.observe([1])
    b.served_prefixes.observe([2])

    class Router:
        engines = (a, b)

    status = prefix_cache_of(Router())()
    digest = PrefixDigest.decode(status["digest"])
    assert 1 in digest and 2 in digest and status["blocks"] == 2
    assert prefix_cache_of(object()) is None  # an engine without a record publishes nothing


def test_rendering_a_chat_records_its_blocks():
    engine = SyntheticEngine(("m",))

    class Request:
        model, prompt, prompts, tools, continue_final, template_kwargs = "m", None, (), (), False, None
        messages = (ChatMessage("system", SYSTEM), ChatMessage("user", "what is owed?"))

    asyncio.run(render_prompt(engine, Request()))
    blocks = chat_block_hashes([("system", SYSTEM), ("user", "what is owed?")])
    assert engine.served_prefixes.digest().matched(blocks) == len(blocks) > 0


def test_the_map_shows_digest_size_and_hit_rate_and_passes_the_digest_on():
    from zerolayer.gpumap import FleetMap
    from zerolayer.map_cli import render_table

    record = ServedPrefixes()
    record.observe([1, 2, 3])
    record.observe([1, 2, 4])
    obj = {"metadata": {"name": "a"}, "spec": {}, "status": {
        "endpoint": "http://a:1", "admitting": True, "lastHeartbeat": "2026-12-04T00:00:00.000Z",
        "prefixCache": record.status()}}
    fleet = FleetMap.from_objects([obj], now=1_796_342_400.0)
    node = fleet.nodes[0]
    assert (node.prefix_blocks, node.prefix_hit_rate) == (4, round(2 / 6, 4))
    assert node.record()["prefixCache"]["digest"] == record.status()["digest"]
    assert "4 hit 33%" in render_table(fleet)
