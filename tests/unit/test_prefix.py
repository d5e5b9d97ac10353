"""Prompt-prefix identity: block hashing, the gossiped digest and the runtime's record of served prefixes."""

from __future__ import annotations

import pytest

from zerolayer.prefix import (
    BLOCK_BYTES, DEFAULT_CAPACITY_BLOCKS, MAX_BLOCKS, PrefixDigest, ServedPrefixes, block_hashes,
    chat_block_hashes, chat_turns, false_positive_rate, prompt_bytes,
)

SYSTEM = "You are the billing assistant of a zero-layer LLM fleet. " * 20  # ~1.2 KB


@pytest.mark.parametrize("size, blocks", [(0, 0), (BLOCK_BYTES - 1, 0), (BLOCK_BYTES, 1), (5 * BLOCK_BYTES + 7, 5),
                                          (10**6, MAX_BLOCKS)])
def test_only_full_blocks_are_hashed_up_to_the_cap(size, blocks):
    assert len(block_hashes(b"x" * size)) == blocks


def test_hashes_are_chained_so_a_block_names_its_whole_prefix():
    a = block_hashes(b"A" * BLOCK_BYTES + b"C" * BLOCK_BYTES)
    b = block_hashes(b"B" * BLOCK_BYTES + b"C" * BLOCK_BYTES)
    assert a[1] != b[1]  # same second block, different parents
    assert block_hashes(b"A" * BLOCK_BYTES + b"C" * BLOCK_BYTES + b"tail") == a  # deterministic, partial ignored


def test_a_shared_system_prompt_shares_its_leading_blocks():
    one = chat_block_hashes(chat_turns({"system": SYSTEM, "messages": [{"role": "user", "content": "how much?"}]}))
    two = chat_block_hashes(chat_turns({"system": SYSTEM, "messages": [{"role": "user", "content": "refund?"}]}))
    shared = len(prompt_bytes([("system", SYSTEM)])) // BLOCK_BYTES
    assert one[:shared] == two[:shared] and shared >= 4


@pytest.mark.parametrize("body, turns", [
    ({"system": "s", "messages": [{"role": "user", "content": "q"}]}, [("system", "s"), ("user", "q")]),
    ({"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "messages": []}, [("system", "ab")]),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "image"}]}]},
     [("system", "s"), ("user", "")]),  # OpenAI chat shape; non-text content contributes nothing
])
def test_chat_turns_read_both_wire_shapes(body, turns):
    assert chat_turns(body) == turns


def test_digest_round_trips_and_matches_leading_blocks():
    blocks = chat_block_hashes([("system", SYSTEM)])
    digest = PrefixDigest.of(blocks[:3])
    decoded = PrefixDigest.decode(digest.encode())
    assert decoded == digest and len(digest.encode()) == 7 + 684
    assert decoded.matched(blocks) == 3
    assert PrefixDigest().fill() == 0.0 and 0 < digest.fill() <= 9 / 4096
    assert decoded.matched(chat_block_hashes([("system", "other " * 300)])) == 0


@pytest.mark.parametrize("value", [None, 3, "", "bloom2:AAAA", "bloom1:not base64!", "bloom1:AAAA"])
def test_an_unreadable_digest_is_none(value):
    assert PrefixDigest.decode(value) is None


def test_false_positives_stay_small_at_capacity():
    assert false_positive_rate(DEFAULT_CAPACITY_BLOCKS) < 0.04
    digest = PrefixDigest.of(range(1, DEFAULT_CAPACITY_BLOCKS + 1))
    strangers = [(i * 0x9E3779B97F4A7C15) & (2**64 - 1) for i in range(10_000, 20_000)]
    assert sum(s in digest for s in strangers) / len(strangers) < 0.05


def test_served_prefixes_keep_the_most_recent_blocks_and_follow_a_reset():
    record = ServedPrefixes(capacity=4)
    assert record.observe([1, 2, 3]) == 0
    v = record.version
    assert record.observe([1, 2, 9]) == 2 and record.version == v + 1  # a new block changes the set
    assert record.observe([1, 2]) == 2 and record.version == v + 1  # nothing new: same version
    record.observe([7])  # capacity 4: the least recently used (3) goes
    assert 3 not in record.digest() and 1 in record.digest() and len(record) == 4
    assert record.hit_rate == pytest.approx(4 / 9)
    record.clear()
    assert len(record) == 0 and 1 not in record.digest()
    status = record.status()
    assert status["blocks"] == 0 and status["blockBytes"] == BLOCK_BYTES and status["digest"].startswith("bloom1:")


def test_the_record_is_no_larger_than_the_engines_cache():
    """With the engine's KV cache size, the record keeps what that cache could hold: cache tokens x the
    observed bytes per token / BLOCK_BYTES blocks; without a token count it keeps ``capacity``."""
    cache = {"tokens": 1024}
    record = ServedPrefixes(capacity=512, cache_tokens=lambda: cache["tokens"])
    prompts = [[("system", f"group {g} " + "word " * 400), ("user", "q")] for g in range(8)]
    for turns in prompts:
        record.observe_turns(turns, tokens=len(prompt_bytes(turns)) // 4)  # 4 bytes per token
    assert record.limit() == 1024 * 4 // BLOCK_BYTES == 16
    assert len(record) == 16
    assert record.digest().matched(chat_block_hashes(prompts[-1])) == len(chat_block_hashes(prompts[-1]))
    assert record.digest().matched(chat_block_hashes(prompts[0])) == 0  # evicted, as the engine would have
    cache["tokens"] = 10**9  # a GPU-sized cache: the Bloom digest's own bound applies
    assert record.limit() == 512
    unsized = ServedPrefixes(capacity=512, cache_tokens=lambda: 1024)
    unsized.observe_turns(prompts[0])  # no token count: nothing to size by
    assert unsized.limit() == 512
