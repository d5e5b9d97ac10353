"""vLLM's KV cache events into the runtime's prefix record (``engine.prefix_digest: kv_events``).

vLLM's engine core publishes its prefix cache's changes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``; ``vllm/distributed/kv_events.py``) on a ZMQ PUB socket when started with
``kv_events_config`` (:meth:`KvEventSubscriber.events_config`). Each message is three frames:
the topic, an 8-byte big-endian sequence number, and a msgpack ``KVEventBatch``, decoded here with
vLLM's own msgspec types.

The subscriber *binds* a SUB socket on 127.0.0.1 with a port the kernel picks, and the engine core's
PUB socket *connects* to it (vLLM connects to any ``tcp://`` endpoint without a wildcard): no port
is guessed, nothing listens beyond loopback, and there is no file to clean up.

:class:`KvEventFeed` is the sans-IO part (frames in, the record fed); :class:`KvEventSubscriber` the
thread and socket. A gap in the sequence (vLLM's PUB drops past its high-water mark, or a message
lost while the engine core restarted) or an undecodable message is logged once, then the record
keeps what it has: the digest may then claim a block the engine evicted (a missed ``BlockRemoved``)
until the engine reports a removal, a clear, or the runtime restarts, and omits blocks whose store
was missed (and their children, which cannot be placed) until vLLM stores them again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

TOPIC = "zerolayer-kv"


class KvEventFeed:
    """Frames of vLLM's KV event stream in, ``record.apply(events)`` out. ``decode``: payload bytes
    to a ``KVEventBatch`` (an object with ``events``). Counts what it saw; logs a problem once."""

    def __init__(self, record: Any, decode: Callable[[bytes], Any]) -> None:
        self.record = record
        self.decode = decode
        self.batches = 0
        self.gaps = 0  # batches known to be missing
        self.undecodable = 0
        self._next_seq: int | None = None
        self._warned = False

    def feed(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._problem("a message of %d frames (expected topic, sequence, payload)", len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self._next_seq is not None and seq > self._next_seq:
            self.gaps += seq - self._next_seq
            self._problem("%d batches missing before sequence %d", seq - self._next_seq, seq)
        self._next_seq = seq + 1
        try:
            batch = self.decode(payload)
        except Exception as exc:  # msgspec.DecodeError / ValidationError: a vLLM of another wire format
            self.undecodable += 1
            self._problem("an undecodable batch (%s)", exc)
            return
        self.record.apply(batch.events)
        self.batches += 1

    def _problem(self, what: str, *args: Any) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning("vLLM KV cache events: " + what + "; the prefix digest keeps its last state and may "
                    "claim blocks the engine evicted until vLLM reports them removed or cleared "
                    "(logged once)", *args)


def vllm_decoder() -> Callable[[bytes], Any]:
    """vLLM's own msgspec decoder for a ``KVEventBatch``."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch).decode


class KvEventSubscriber:
    """A thread receiving vLLM's KV cache events into ``record`` (see the module doc). Create, pass
    :meth:`events_config` to the engine, :meth:`start`; :meth:`stop` when the engine stops."""

    POLL_MS = 200  # how soon stop() is noticed

    def __init__(self, record: Any, decode: Callable[[bytes], Any] | None = None, topic: str = TOPIC) -> None:
        import zmq

        self.topic = topic
        self.feed = KvEventFeed(record, decode or vllm_decoder())
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop here: vLLM's side bounds the queue
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def events_config(self) -> dict[str, Any]:
        """``KVEventsConfig``'s fields for the engine: publish to this subscriber."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint, "topic": self.topic}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(self.POLL_MS):
                    self.feed.feed(self._socket.recv_multipart())
        except Exception as exc:  # zmq.ZMQError, or an event the record cannot read: the thread ends, said once
            if not self._stop.is_set():
                log.warning("vLLM KV cache events: the subscriber stopped (%s); the prefix digest keeps its "
                            "last state", exc)
        finally:
            self._socket.close(linger=0)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
            if thread.is_alive():  # a daemon thread: it ends with the process; term() would wait on it
                return
        else:
            self._socket.close(linger=0)
        self._context.term()


def attach(record: Any, args: dict[str, Any]) -> tuple[KvEventSubscriber | None, dict[str, Any]]:
    """For a record driven by KV cache events (:class:`~zerolayer.engine_prefixes.EngineCachedPrefixes`):
    a started subscriber feeding it, and the engine's ``args`` with vLLM's ``kv_events_config``
    pointing at it (started before the engine, so no event of its first steps is missed). For any
    other record: no subscriber, ``args`` as they are. Prefix caching must be on (the config layer
    refuses ``kv_events`` with it off)."""
    from zerolayer.engine_prefixes import EngineCachedPrefixes

    if not isinstance(record, EngineCachedPrefixes):
        return None, args
    from vllm.config import KVEventsConfig

    subscriber = KvEventSubscriber(record)
    subscriber.start()
    return subscriber, {**args, "kv_events_config": KVEventsConfig(**subscriber.events_config())}


def detach(subscriber: KvEventSubscriber | None) -> None:
    """Stop ``subscriber`` (None, or already stopped: nothing to do)."""
    if subscriber is not None:
        subscriber.stop()
