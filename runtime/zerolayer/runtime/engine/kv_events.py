"""vLLM's KV cache events into the runtime's prefix record (``engine.prefix_digest: kv_events``).

vLLM's engine core publishes its prefix cache's changes (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``; ``vllm/distributed/kv_events.py``) on a ZMQ PUB socket when started with
``kv_events_config`` (:meth:`KvEventSubscriber.events_config`). Each message is three frames:
the topic, an 8-byte big-endian sequence number, and a msgpack ``KVEventBatch``, decoded here with
vLLM's own msgspec types.

The subscriber *binds* a SUB socket on 127.0.0.1 with a port the kernel picks, and the engine core's
PUB socket *connects* to it (vLLM connects to any ``tcp://`` endpoint without a wildcard): no port
is guessed and nothing listens beyond loopback. (The replay socket below is the one file, removed at
stop.)

**Several API processes, one engine core** (``server.api_processes``, docs/api-processes.md). A PUB
that connects reaches one bound SUB, so the parent that launches the shared engine core gives it
:func:`shared_events_config` instead: both sockets are ``ipc://`` paths in a directory the parent
made (mode 0700), which vLLM *binds* (``ZmqEventPublisher._is_bind_endpoint``: ``ipc://`` endpoints
are bound), and every API process's subscriber *connects* to them (``KvEventSubscriber(...,
publisher=...)``). Each process needs the whole stream: a byte block of its digest is linked to
token blocks only by the chats that process rendered, so one subscriber could not place another
process's chats. A subscriber that joins late (the engine core published before its subscription
arrived) sees a first sequence above 0 and replays the rest, as for any gap.

:class:`KvEventFeed` is the sans-IO part (frames in, the record fed); :class:`KvEventSubscriber` the
thread and sockets.

**Missed batches are replayed.** PUB/SUB drops silently: the first batches while vLLM's PUB is still
connecting (ZMQ's "slow joiner"), and any past vLLM's high-water mark. Every batch carries a sequence
number from 0, so the feed knows what it missed: the batch after a gap waits while the missed ones
are fetched from vLLM's replay socket (a ROUTER the engine core binds at ``replay_endpoint`` and
answers from its last ``buffer_steps`` batches: ``vllm/distributed/kv_events.py``), applied in order,
then the waiting one. The replay socket is an ``ipc://`` path in a directory only this process's user
can enter, removed at :meth:`KvEventSubscriber.stop`: nothing listens on the network. What the
replay cannot return (older than vLLM's buffer, or no answer in :data:`REPLAY_TIMEOUT_MS`) and
undecodable messages are counted and logged once, then the record keeps what it has: the digest may
then claim a block the engine evicted (a missed ``BlockRemoved``) until the engine reports a removal,
a clear, or the runtime restarts, and omits blocks whose store was missed (and their children,
which cannot be placed) until vLLM stores them again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Sequence

from zerolayer.runtime.errors import EngineError

log = logging.getLogger(__name__)

TOPIC = "zerolayer-kv"
REPLAY_BUFFER_STEPS = 10_000  # vLLM's default: batches its engine core keeps for replay
REPLAY_TIMEOUT_MS = 1_000  # the most one replay waits for the engine core's next frame
END_SEQ = -1  # the replay's last frame (vLLM's ZmqEventPublisher.END_SEQ)

#: ``replay(start)``: the ``[topic, sequence, payload]`` frames vLLM still holds from ``start`` on.
Replay = Callable[[int], Sequence[Sequence[bytes]]]


class KvEventFeed:
    """Frames of vLLM's KV event stream in, ``record.apply(events)`` out. ``decode``: payload bytes
    to a ``KVEventBatch`` (an object with ``events``). ``replay`` (optional): fetches missed batches
    (see the module doc); the stream is expected from sequence 0, the engine core's first batch.
    Counts what it saw; logs a problem once."""

    def __init__(self, record: Any, decode: Callable[[bytes], Any], replay: Replay | None = None) -> None:
        self.record = record
        self.decode = decode
        self.replay = replay
        self.batches = 0
        self.gaps = 0  # batches known to be missing and not recovered
        self.replayed = 0  # batches recovered by replay
        self.undecodable = 0
        self._next_seq = 0
        self._warned = False

    def feed(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            self._problem("a message of %d frames (expected topic, sequence, payload)", len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq > self._next_seq:
            self._recover(self._next_seq, seq)
        # A sequence that goes back (an engine core restarted and counts from 0 again) starts over.
        self._next_seq = seq + 1
        self._apply(payload)

    def _recover(self, first: int, upto: int) -> None:
        """Batches ``first .. upto - 1`` were missed: replay what vLLM still holds, in order."""
        got: dict[int, bytes] = {}
        if self.replay is not None:
            try:
                for frames in self.replay(first):
                    if len(frames) == 3:
                        seq = int.from_bytes(frames[1], "big", signed=True)
                        if first <= seq < upto:
                            got[seq] = frames[2]
            except Exception as exc:  # zmq.ZMQError: the engine core went away; what is missing is said below
                log.debug("vLLM KV cache events: replay failed: %s", exc)
        for seq in sorted(got):
            self._apply(got[seq])
        self.replayed += len(got)
        missing = upto - first - len(got)
        if missing:
            self.gaps += missing
            self._problem("%d batches missing before sequence %d (%d replayed)", missing, upto, len(got))

    def _apply(self, payload: bytes) -> None:
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


def shared_events_config(directory: str, topic: str = TOPIC) -> dict[str, Any]:
    """``KVEventsConfig``'s fields for an engine core several API processes subscribe to (see the
    module doc): the PUB and replay sockets as ``ipc://`` paths in ``directory`` (the caller's, mode
    0700, removed by it once the engine core stopped), which vLLM binds; each process's
    ``KvEventSubscriber(record, publisher=<these fields>)`` connects."""
    return events_fields(f"ipc://{os.path.join(directory, 'events')}", f"ipc://{os.path.join(directory, 'replay')}",
                         topic)


def events_fields(endpoint: str, replay_endpoint: str, topic: str) -> dict[str, Any]:
    """``KVEventsConfig``'s fields for vLLM's ZMQ publisher on ``endpoint``, answering replays on
    ``replay_endpoint``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic,
            "replay_endpoint": replay_endpoint, "buffer_steps": REPLAY_BUFFER_STEPS}


class KvEventSubscriber:
    """A thread receiving vLLM's KV cache events into ``record`` (see the module doc). Create, pass
    :meth:`events_config` to the engine, :meth:`start`; :meth:`stop` when the engine stops.
    ``publisher``: the fields of an engine core that binds its own sockets (:func:`shared_events_config`);
    the subscriber then connects to them and leaves their directory to whoever made it."""

    POLL_MS = 200  # how soon stop() is noticed

    def __init__(self, record: Any, decode: Callable[[bytes], Any] | None = None, topic: str = TOPIC,
                 publisher: dict[str, Any] | None = None) -> None:
        import zmq

        self.topic = topic if publisher is None else publisher["topic"]
        self.feed = KvEventFeed(record, decode or vllm_decoder(), replay=self.replay)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop here: vLLM's side bounds the queue
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._replay_dir: str | None = None  # ours to remove at stop (bind mode only)
        if publisher is None:
            port = self._socket.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
            self._replay_dir = tempfile.mkdtemp(prefix="zerolayer-kv-")  # mode 0700: this user's only
            self.replay_endpoint = f"ipc://{os.path.join(self._replay_dir, 'replay')}"
        else:
            self.endpoint, self.replay_endpoint = publisher["endpoint"], publisher["replay_endpoint"]
            self._socket.connect(self.endpoint)  # before the engine core binds it, too: ZMQ retries
        self._dealer: Any = None  # the replay client, made and used on the subscriber thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def events_config(self) -> dict[str, Any]:
        """``KVEventsConfig``'s fields for the engine: publish to this subscriber, answer its replays
        (with ``publisher``: those fields, where the engine core binds)."""
        return events_fields(self.endpoint, self.replay_endpoint, self.topic)

    def replay(self, start: int) -> list[list[bytes]]:
        """Ask the engine core for its buffered batches from ``start`` on (vLLM's replay protocol: an
        empty frame and the start sequence; ``topic, sequence, payload`` frames back until
        :data:`END_SEQ`). Called on the subscriber thread (by the feed). A replay that goes
        unanswered for :data:`REPLAY_TIMEOUT_MS` returns what came, and the socket is made anew so
        that a late answer cannot be read as the next replay's."""
        import zmq

        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        self._dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out: list[list[bytes]] = []
        while True:
            if not self._dealer.poll(REPLAY_TIMEOUT_MS):
                self._dealer.close(linger=0)
                self._dealer = None
                return out
            frames = self._dealer.recv_multipart()[1:]  # the empty delimiter first
            if len(frames) != 3 or int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                return out
            out.append(frames)

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
            if self._dealer is not None:
                self._dealer.close(linger=0)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._replay_dir is not None:
            shutil.rmtree(self._replay_dir, ignore_errors=True)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
            if thread.is_alive():  # a daemon thread: it ends with the process; term() would wait on it
                return
        else:
            self._socket.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)
        self._context.term()


def attach(record: Any, args: dict[str, Any],
           core_client: Any = None) -> tuple[KvEventSubscriber | None, dict[str, Any]]:
    """For a record driven by KV cache events (:class:`~zerolayer.engine_prefixes.EngineCachedPrefixes`):
    a started subscriber feeding it, and the engine's ``args`` with vLLM's ``kv_events_config``
    pointing at it (started before the engine, so no event of its first steps is missed). With
    ``core_client`` (an API process's :class:`~zerolayer.runtime.engine.shared_core.CoreClient`, whose
    ``kv_events`` are the fields its launcher gave the shared engine core: :func:`shared_events_config`):
    a subscriber connected to those, and ``args`` as they are. For any other record: no subscriber,
    ``args`` as they are. Prefix caching must be on (the config layer refuses ``kv_events`` with it off)."""
    from zerolayer.engine_prefixes import EngineCachedPrefixes

    if not isinstance(record, EngineCachedPrefixes):
        return None, args
    publisher = getattr(core_client, "kv_events", None)
    if core_client is not None and publisher is None:  # the launcher gave the engine core no event sockets
        raise EngineError("prefix_digest: kv_events on an API process whose engine core publishes no KV events")
    if publisher is not None:
        subscriber = KvEventSubscriber(record, publisher=publisher)
        subscriber.start()
        return subscriber, args
    from vllm.config import KVEventsConfig

    subscriber = KvEventSubscriber(record)
    subscriber.start()
    return subscriber, {**args, "kv_events_config": KVEventsConfig(**subscriber.events_config())}


def detach(subscriber: KvEventSubscriber | None) -> None:
    """Stop ``subscriber`` (None, or already stopped: nothing to do)."""
    if subscriber is not None:
        subscriber.stop()
