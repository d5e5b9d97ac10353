"""The prefix digest driven by the engine's KV cache events (zerolayer.engine_prefixes): events in, digest out.

The events are stand-ins with vLLM's class names and fields (vllm/distributed/kv_events.py), so
nothing here needs vLLM; the real engine's stream is tests/integration/runtime/test_kv_events_vllm.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from zerolayer.engine_prefixes import (
    LINKS_PER_BLOCK, EngineCachedPrefixes, byte_block_links, token_key, token_keys)
from zerolayer.prefix import BLOCK_BYTES, ROOT, PrefixDigest, chat_block_hashes, merged_status, prompt_bytes

BS = 16  # tokens per KV block
SYSTEM = "You are the billing assistant of a zero-layer LLM fleet. " * 20  # ~1.2 KB


@dataclasses.dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    medium: str | None = "GPU"


@dataclasses.dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"


@dataclasses.dataclass
class AllBlocksCleared:
    pass


def chat(question: str) -> list[tuple[str, str]]:
    """The chat, its question padded so its layout is whole 4-byte tokens (depths then map exactly)."""
    while len(prompt_bytes([("system", SYSTEM), ("user", question)])) % 4:
        question += "?"
    return [("system", SYSTEM), ("user", question)]


def tokens_of(turns: list[tuple[str, str]]) -> list[int]:
    """A stand-in tokenizer: one token per 4 bytes of the layout (ids from the bytes, so equal text, equal ids)."""
    data = prompt_bytes(turns)
    return [int.from_bytes(data[i:i + 4].ljust(4, b"\0"), "big") for i in range(0, len(data), 4)]


def observed(question: str = "q", **kw) -> tuple[EngineCachedPrefixes, list[tuple[str, str]], list[int]]:
    """A record (``kw``: its settings; block size ``BS`` unless given) that has seen one rendered chat."""
    record = EngineCachedPrefixes(**{"block_size": BS, **kw})
    turns = chat(question)
    ids = tokens_of(turns)
    record.observe_turns(turns, token_ids=ids)
    return record, turns, ids


def store_all(record: EngineCachedPrefixes, ids: list[int], *, upto: int | None = None, tag: str = "h") -> list:
    """What vLLM reports after prefilling ``ids``: one BlockStored per block (as a chunked prefill may),
    each chained on the one before; returns vLLM's hashes."""
    full = len(ids) // BS if upto is None else upto
    hashes = [f"{tag}{j}".encode() for j in range(full)]
    record.apply([BlockStored([hashes[j]], hashes[j - 1] if j else None, ids[j * BS:(j + 1) * BS], BS)
                  for j in range(full)])
    return hashes


def test_a_rendered_chat_is_in_the_digest_only_once_the_engine_stored_its_blocks():
    record = EngineCachedPrefixes(block_size=BS)
    turns = chat("how much?")
    ids = tokens_of(turns)
    assert record.observe_turns(turns, tokens=len(ids), token_ids=ids) == 0
    blocks = chat_block_hashes(turns)
    assert len(blocks) >= 4 and len(record) == 0 and record.digest().matched(blocks) == 0  # rendered, not cached
    version = record.version
    store_all(record, ids)
    assert record.version != version
    assert record.digest().matched(blocks) == len(blocks) == len(record)
    status = record.status()
    assert status["blocks"] == len(blocks) and status["blockBytes"] == BLOCK_BYTES and status["hitRate"] == 0.0
    assert PrefixDigest.decode(status["digest"]) == record.digest()


def test_only_byte_blocks_covered_by_stored_token_blocks_are_held():
    record, turns, ids = observed("how much?")
    store_all(record, ids, upto=(2 * BLOCK_BYTES // 4) // BS)  # the tokens of the first 512 bytes: 8 blocks
    assert record.digest().matched(chat_block_hashes(turns)) == 2


def test_a_chat_sharing_the_system_prompt_hits_what_another_chat_stored():
    record = EngineCachedPrefixes(block_size=BS)
    first = chat("how much?")
    record.observe_turns(first, token_ids=tokens_of(first))
    store_all(record, tokens_of(first))
    second = chat("may I have a refund for the last three months, please?")
    shared = len(prompt_bytes([("system", SYSTEM)])) // BLOCK_BYTES
    assert record.observe_turns(second, token_ids=tokens_of(second)) >= shared - 1
    assert record.digest().matched(chat_block_hashes(second)) >= shared - 1
    assert record.hit_rate is not None and record.hit_rate > 0


def test_removal_unmarks_the_blocks_above_it_and_clear_empties_the_digest():
    record, turns, ids = observed("how much?")
    hashes = store_all(record, ids)
    blocks = chat_block_hashes(turns)
    record.apply([BlockRemoved(hashes[8:])])  # vLLM evicted everything past the first 512 bytes' tokens
    assert record.digest().matched(blocks) == 2 and len(record) == 2
    record.apply([BlockRemoved([b"never-stored"])])  # unknown hashes are ignored
    record.apply([AllBlocksCleared()])
    assert len(record) == 0 and record.digest().matched(blocks) == 0
    store_all(record, ids)  # stored again after the reset: the chat's links were kept
    assert record.digest().matched(blocks) == len(blocks)
    record.clear()  # the runtime's own reset: links too
    store_all(record, ids, tag="again")
    assert len(record) == 0


def test_a_block_named_by_two_engine_hashes_stays_until_both_are_removed():
    record, turns, ids = observed("q")
    one = store_all(record, ids, tag="base")
    two = store_all(record, ids, tag="lora")  # the same tokens under an adapter: other hashes, same key
    record.apply([BlockRemoved(one)])
    assert record.digest().matched(chat_block_hashes(turns)) > 0
    record.apply([BlockRemoved(two)])
    assert len(record) == 0


def test_a_block_reported_again_is_not_counted_twice():
    record, turns, ids = observed("q")
    hashes = store_all(record, ids)
    store_all(record, ids)  # vLLM's "full" report mode re-reports a prefix-cache hit
    record.apply([BlockRemoved(hashes)])
    assert len(record) == 0


def test_events_that_cannot_be_placed_or_belong_elsewhere_are_ignored():
    record, turns, ids = observed("q")
    record.apply([BlockStored([b"x1"], b"missed-parent", ids[BS:2 * BS], BS)])  # its parent's store was missed
    assert record.unplaced == 1 and len(record) == 0
    record.apply([BlockStored([b"c0"], None, ids[:BS], BS, medium="CPU")])  # an offloading tier's copy
    record.apply([object()])  # an event kind this record does not know
    assert len(record) == 0


def test_the_bounds_links_per_byte_block_and_engine_hashes():
    record, turns, ids = observed("q", capacity=4, max_engine_blocks=8)
    assert len(record._links) == 4  # the 4 most recently rendered byte blocks of this chat's ~5
    for n in range(LINKS_PER_BLOCK + 3):  # the same byte blocks, each prompt mapping them differently
        record.observe_turns(turns, token_ids=ids + [7] * (n + 1) * 40)
    assert all(len(keys) <= LINKS_PER_BLOCK for keys in record._links.values())
    store_all(record, ids)
    assert len(record._engine) == 8 and sum(record._held.values()) == 8  # the oldest hashes aged out
    assert len(record) <= 4


def test_without_token_ids_or_a_block_size_nothing_is_linked():
    record = EngineCachedPrefixes()
    turns = chat("q")
    record.observe_turns(turns, token_ids=tokens_of(turns))  # block size unknown yet
    record.observe_turns(turns, tokens=99)
    assert record._links == {} and record.blocks_seen == 2 * len(chat_block_hashes(turns))
    store_all(record, tokens_of(turns))
    assert record.block_size == BS  # learnt from the first stored event


def test_token_chain_keys_and_the_proportional_mapping():
    assert token_keys(list(range(40)), 16) == [token_key(ROOT, range(16)), token_key(token_key(ROOT, range(16)),
                                                                                      range(16, 32))]
    # 1024 bytes over 256 tokens: byte block i ends at token 64 (i + 1), i.e. after token block 4 (i + 1) - 1
    assert byte_block_links(1024, 256, 16, 16) == [3, 7, 11, 15]
    assert byte_block_links(1024, 250, 16, 15) == [3, 7, 11]  # the last reaches the partial token block
    with pytest.raises(ValueError):
        EngineCachedPrefixes(capacity=0)


def test_the_gossip_merges_it_with_other_records():
    record = EngineCachedPrefixes(block_size=BS)
    turns = chat("q")
    record.observe_turns(turns, token_ids=tokens_of(turns))
    store_all(record, tokens_of(turns))
    merged = merged_status([record, EngineCachedPrefixes()])
    assert PrefixDigest.decode(merged["digest"]).matched(chat_block_hashes(turns)) == len(record)


def test_the_engines_block_size_and_block_count_are_read_once_it_knows_them():
    known: dict = {"cache": None}
    record = EngineCachedPrefixes(engine_blocks=lambda: known["cache"])
    turns = chat("q")
    record.observe_turns(turns, token_ids=tokens_of(turns))
    assert record.block_size is None and record._links == {}  # not started yet
    known["cache"] = (BS, 100)
    record.observe_turns(turns, token_ids=tokens_of(turns))
    assert (record.block_size, record.max_engine_blocks) == (BS, 100) and record._links
