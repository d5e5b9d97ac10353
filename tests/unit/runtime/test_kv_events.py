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


class Engine:
    """A stand-in for vLLM's engine core with ``prefix_digest: kv_events`` and several API processes
    (``ZmqEventPublisher`` given :func:`shared_events_config`): a PUB *bound* on the ``ipc://`` endpoint
    and a ROUTER answering vLLM's replay protocol (an empty frame and the start sequence; ``topic,
    sequence, payload`` back, then the end marker) from every batch it published."""

    def __init__(self, config: dict) -> None:
        import zmq

        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(config["endpoint"])
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(config["replay_endpoint"])
        self.topic = config["topic"].encode()
        self.sent: list[bytes] = []

    def publish(self, payload: bytes) -> None:
        self.pub.send_multipart([self.topic, len(self.sent).to_bytes(8, "big"), payload])
        self.sent.append(payload)

    def answer_replays(self) -> int:
        """Answer the replay requests waiting now; how many."""
        answered = 0
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(self.sent)):
                self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), self.sent[seq]])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            answered += 1
        return answered

    def close(self) -> None:
        self.pub.close()
        self.router.close()
        self.context.term()


def _until(check, what: str, timeout: float = 10.0, between=lambda: None) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        between()
        time.sleep(0.02)


def test_shared_events_config_puts_both_sockets_in_the_callers_directory(tmp_path):
    from zerolayer.runtime.engine.kv_events import shared_events_config

    config = shared_events_config(str(tmp_path))
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/events",
                      "topic": "zerolayer-kv", "replay_endpoint": f"ipc://{tmp_path}/replay", "buffer_steps": 10_000}


def test_subscribers_of_several_api_processes_connect_to_the_engine_cores_bound_socket(tmp_path):
    """Two subscribers (two API processes) connect to the one PUB the engine core binds; each gets every
    batch. A PUB drops what it sends before a subscription reached it: those come back by replay, so
    each subscriber applies batch 0 onwards, in order, with nothing missing. Stopping a connected
    subscriber leaves the directory to its maker (the parent)."""
    pytest.importorskip("zmq")
    from zerolayer.runtime.engine.kv_events import shared_events_config

    config = shared_events_config(str(tmp_path))
    engine = Engine(config)
    applied: list[list[bytes]] = [[], []]

    class Record:
        def __init__(self, into: list) -> None:
            self.into = into

        def apply(self, events: list) -> None:
            self.into.extend(events)

    subscribers = [KvEventSubscriber(Record(into), decode=lambda payload: Batch([payload]), publisher=config)
                   for into in applied]
    try:
        for subscriber in subscribers:
            assert subscriber.events_config() == config
            subscriber.start()
        n = 0

        def publish() -> None:  # until both subscriptions arrived; what they missed is replayed
            nonlocal n
            engine.publish(b"b%d" % n)
            n += 1
            engine.answer_replays()

        _until(lambda: all(applied), "no batch reached both subscribers", between=publish)
        _until(lambda: all(len(a) == len(engine.sent) for a in applied), "a subscriber missed batches",
               between=engine.answer_replays)
        for got, subscriber in zip(applied, subscribers):
            assert got == engine.sent  # b0, b1, ... in order
            assert subscriber.feed.gaps == 0 and subscriber.feed.batches == len(engine.sent)
    finally:
        for subscriber in subscribers:
            subscriber.stop()
        engine.close()
    assert tmp_path.is_dir()  # the parent's to remove, once the engine core stopped


def test_a_subscriber_that_joins_after_the_engine_published_recovers_every_batch_by_replay(tmp_path):
    """The engine core published batches 0-2 before this subscriber existed (an API process that
    started late, or ZMQ's slow joiner), then 3 and more (empty) ones until one arrived. The first
    batch it receives is 3 or later: it replays the earlier ones from the engine core's ROUTER and
    applies them in order first, so the blocks chained on the missed ones are placed."""
    pytest.importorskip("zmq")
    from zerolayer.runtime.engine.kv_events import shared_events_config

    record = EngineCachedPrefixes(block_size=BS)
    turns = chat("q")
    ids = tokens_of(turns)
    record.observe_turns(turns, token_ids=ids)
    stored = [[BlockStored([b"h%d" % j], b"h%d" % (j - 1) if j else None, ids[j * BS:(j + 1) * BS], BS)]
              for j in range(4)]  # the chat's first 4 token blocks, one batch each, each chained on the last
    config = shared_events_config(str(tmp_path))
    engine = Engine(config)
    for j in range(3):
        engine.publish(b"%d" % j)
    subscriber = KvEventSubscriber(record, decode=lambda payload: Batch(stored[int(payload)] if payload else []),
                                   publisher=config)
    try:
        subscriber.start()
        engine.publish(b"3")
        _until(lambda: subscriber.feed.batches > 0, "nothing reached the late subscriber",
               between=lambda: (engine.publish(b""), engine.answer_replays()))
        _until(lambda: subscriber.feed.batches == len(engine.sent), "the late subscriber missed batches",
               between=engine.answer_replays)
        assert subscriber.feed.replayed >= 3 and subscriber.feed.gaps == 0 and record.unplaced == 0
        assert record.digest().matched(chat_block_hashes(turns)) == 1  # 4 token blocks cover the first 256 bytes
    finally:
        subscriber.stop()
        engine.close()


def test_metrics_show_the_blocks_each_record_holds_and_the_event_batches_fed_to_it():
    """``zerolayer_prefix_digest_blocks`` per engine; ``zerolayer_kv_events_*`` only for an engine fed by
    vLLM's KV events (with several API processes, each process's page, labelled by the parent)."""
    from prometheus_client import CollectorRegistry

    from zerolayer.runtime.gossip.metrics import PrefixDigestCollector

    record = EngineCachedPrefixes(block_size=BS)
    turns = chat("q")
    ids = tokens_of(turns)
    record.observe_turns(turns, token_ids=ids)
    feed = KvEventFeed(record, lambda payload: Batch([BlockStored([b"h0", b"h1", b"h2", b"h3"], None,
                                                                  ids[:4 * BS], BS)]))
    feed.feed(frames(0))
    feed.feed(frames(2))  # 1 missed, no replay
    served = ServedPrefixes()
    served.observe_turns(turns)

    @dataclasses.dataclass
    class Engine:
        models: tuple
        served_prefixes: object
        kv_event_feed: object = None

    @dataclasses.dataclass
    class Engines:
        engines: list

    registry = CollectorRegistry()
    registry.register(PrefixDigestCollector(Engines([Engine(("a",), record, feed), Engine(("b",), served)])))
    value = registry.get_sample_value
    assert value("zerolayer_prefix_digest_blocks", {"model_name": "a"}) == 1
    assert value("zerolayer_prefix_digest_blocks", {"model_name": "b"}) == len(chat_block_hashes(turns))
    assert value("zerolayer_kv_events_batches_total", {"model_name": "a"}) == 2
    assert value("zerolayer_kv_events_missed_total", {"model_name": "a"}) == 1
    assert value("zerolayer_kv_events_batches_total", {"model_name": "b"}) is None
