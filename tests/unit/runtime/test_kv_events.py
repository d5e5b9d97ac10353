"""vLLM's KV cache event stream into the prefix record: the feed (frames in, record fed; gaps and
garbage logged once, state kept) and the ``prefix_digest`` config key. Nothing here starts vLLM."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import pytest

from tests.unit.test_engine_prefixes import BS, BlockStored, chat, tokens_of
from zerolayer.engine_prefixes import EngineCachedPrefixes
from zerolayer.prefix import ServedPrefixes, chat_block_hashes
from zerolayer.runtime.config import build_engine, parse_config
from zerolayer.runtime.engine.kv_events import KvEventFeed, KvEventSubscriber
from zerolayer.runtime.errors import ConfigError


@dataclasses.dataclass
class Batch:
    events: list


def frames(seq: int, payload: bytes = b"ok") -> list[bytes]:
    return [b"zerolayer-kv", seq.to_bytes(8, "big"), payload]


def test_the_feed_applies_batches_and_logs_a_gap_once(caplog):
    record = EngineCachedPrefixes(block_size=BS)
    turns = chat("q")
    ids = tokens_of(turns)
    record.observe_turns(turns, token_ids=ids)
    events = [BlockStored([b"h0", b"h1", b"h2", b"h3"], None, ids[:4 * BS], BS)]  # the first 256 bytes' tokens
    feed = KvEventFeed(record, lambda payload: Batch(events if payload == b"ok" else []))
    caplog.set_level(logging.WARNING, "zerolayer.runtime.engine.kv_events")
    feed.feed(frames(0))
    feed.feed(frames(3))  # 1 and 2 were dropped
    feed.feed(frames(7))
    assert feed.batches == 3 and feed.gaps == 5
    assert [r.message for r in caplog.records if "missing" in r.message] == [caplog.records[0].message]
    assert "keeps its last state" in caplog.records[0].message
    assert record.digest().matched(chat_block_hashes(turns)) == 1  # the state is kept, not reset


def test_a_gap_is_replayed_in_order_before_the_batch_that_revealed_it():
    applied: list[bytes] = []

    class Record:
        def apply(self, events: list) -> None:
            applied.extend(events)

    asked: list[int] = []

    def replay(start: int) -> list[list[bytes]]:  # what vLLM's buffer still holds: everything from 0
        asked.append(start)
        return [frames(seq, b"b%d" % seq) for seq in range(0, 9)]

    feed = KvEventFeed(Record(), lambda payload: Batch([payload]), replay=replay)
    feed.feed(frames(0, b"b0"))
    feed.feed(frames(3, b"b3"))  # 1 and 2 were dropped: replayed first, then 3
    feed.feed(frames(4, b"b4"))
    assert applied == [b"b0", b"b1", b"b2", b"b3", b"b4"]
    assert asked == [1] and feed.replayed == 2 and feed.gaps == 0 and feed.batches == 5


def test_the_first_batches_a_slow_joiner_missed_are_replayed_from_zero():
    applied: list[bytes] = []

    class Record:
        def apply(self, events: list) -> None:
            applied.extend(events)

    feed = KvEventFeed(Record(), lambda payload: Batch([payload]),
                       replay=lambda start: [frames(seq, b"b%d" % seq) for seq in range(start, 3)])
    feed.feed(frames(2, b"b2"))  # the PUB connected late: 0 and 1 went nowhere
    assert applied == [b"b0", b"b1", b"b2"] and feed.replayed == 2 and feed.gaps == 0


def test_what_the_replay_cannot_return_is_counted_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, "zerolayer.runtime.engine.kv_events")
    applied: list[bytes] = []

    class Record:
        def apply(self, events: list) -> None:
            applied.extend(events)

    def replay(start: int) -> list[list[bytes]]:
        if start > 5:
            raise OSError("the engine core went away")
        return [frames(2, b"b2"), [b"short"]]  # 1 aged out of vLLM's buffer; a malformed frame is skipped

    feed = KvEventFeed(Record(), lambda payload: Batch([payload]), replay=replay)
    feed.feed(frames(0, b"b0"))
    feed.feed(frames(3, b"b3"))
    feed.feed(frames(9, b"b9"))  # 4..8: the replay fails
    assert applied == [b"b0", b"b2", b"b3", b"b9"]
    assert feed.replayed == 1 and feed.gaps == 1 + 5
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and "1 batches missing before sequence 3 (1 replayed)" in warnings[0]


def test_a_sequence_that_starts_over_is_an_engine_core_restart_not_a_gap():
    feed = KvEventFeed(EngineCachedPrefixes(block_size=BS), lambda payload: Batch([]),
                       replay=lambda start: pytest.fail("nothing was missed"))
    for seq in (0, 1, 2, 0, 1):
        feed.feed(frames(seq))
    assert feed.batches == 5 and feed.gaps == 0


def test_the_feed_skips_what_it_cannot_read():
    record = EngineCachedPrefixes(block_size=BS)

    def decode(payload: bytes) -> Batch:
        raise ValueError("not a KVEventBatch")

    feed = KvEventFeed(record, decode)
    feed.feed(frames(0, b"garbage"))
    feed.feed([b"short"])
    assert feed.undecodable == 1 and feed.batches == 0


def config(engine: dict) -> object:
    return parse_config({"engine": engine}, pathlib.Path("."))


VLLM = {"kind": "vllm", "model_path": "/models/m"}


def test_prefix_digest_defaults_to_served_and_kv_events_is_opt_in():
    assert isinstance(build_engine(config({})).served_prefixes, ServedPrefixes)
    assert isinstance(build_engine(config({"prefix_digest": "served"})).served_prefixes, ServedPrefixes)
    assert isinstance(build_engine(config(VLLM)).served_prefixes, ServedPrefixes)
    engine = build_engine(config({**VLLM, "prefix_digest": "kv_events"}))
    assert isinstance(engine.served_prefixes, EngineCachedPrefixes)
    assert engine.served_prefixes.block_size is None  # the engine's, read once it started


@pytest.mark.parametrize("engine, refusal", [
    ({"prefix_digest": "kv_events"}, "kv_events needs the vllm engine"),
    ({"kind": "synthetic", "prefix_digest": "kv_events"}, "the synthetic engine has none: use served"),
    ({**VLLM, "prefix_digest": "events"}, "prefix_digest: one of served, kv_events, got 'events'"),
    ({**VLLM, "prefix_digest": "kv_events", "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({**VLLM, "prefix_digest": "kv_events", "engine_args": {"kv_events_config": {}}},
     "engine_args kv_events_config: prefix_digest kv_events sets it"),
])
def test_prefix_digest_is_refused_by_name_where_it_cannot_work(engine, refusal):
    with pytest.raises(ConfigError, match=refusal):
        config(engine)


def test_without_kv_events_a_vllm_engine_may_pass_its_own_kv_events_config():
    assert config({**VLLM, "engine_args": {"kv_events_config": {}}}).engine["engine_args"] == {"kv_events_config": {}}


def test_the_subscriber_binds_loopback_and_feeds_the_record_from_a_connecting_publisher():
    """What vLLM's ZmqEventPublisher does with a tcp:// endpoint without a wildcard: connect a PUB socket
    and send (topic, 8-byte sequence, payload). Here with a stand-in decoder; vLLM's own is tested on the
    real engine (tests/integration/runtime/test_kv_events_vllm.py)."""
    zmq = pytest.importorskip("zmq")
    import time

    applied: list = []

    class Record:
        def apply(self, events: list) -> None:
            applied.extend(events)

    subscriber = KvEventSubscriber(Record(), decode=lambda payload: Batch([payload]))
    assert subscriber.endpoint.startswith("tcp://127.0.0.1:")
    assert subscriber.events_config() == {"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": subscriber.endpoint, "topic": "zerolayer-kv",
                                          "replay_endpoint": subscriber.replay_endpoint, "buffer_steps": 10_000}
    replay_dir = pathlib.Path(subscriber.replay_endpoint.removeprefix("ipc://")).parent
    assert subscriber.replay_endpoint.startswith("ipc://") and replay_dir.stat().st_mode & 0o077 == 0
    subscriber.start()
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(subscriber.endpoint)
    try:
        deadline, seq = time.monotonic() + 10, 0
        while not applied:  # a PUB drops what it sends before the subscription has reached it
            assert time.monotonic() < deadline, "nothing arrived"
            pub.send_multipart([b"zerolayer-kv", seq.to_bytes(8, "big"), b"event"])
            seq += 1
            time.sleep(0.05)
        assert applied[0] == b"event" and subscriber.feed.batches >= 1
    finally:
        pub.close()
        context.term()
        subscriber.stop()
        subscriber.stop()  # idempotent
    assert not replay_dir.exists()
