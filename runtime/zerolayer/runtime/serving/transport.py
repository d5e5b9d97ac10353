"""The one module that touches sockets: asyncio protocols driving the sans-IO cores.

One :class:`Connection` per TCP connection. It picks the core — HTTP/2 when TLS ALPN
chose ``h2`` or the first bytes are the HTTP/2 preface (h2c prior knowledge), else
HTTP/1.1 — feeds it bytes, writes what it produces, runs a task per ready request and
keeps the timers: PING when idle, idle timeout, the cores' slow-peer timeouts
(``expire``), the drain deadline and the connection's age (:class:`ConnectionAge`).
Backpressure: a stream's producer waits while its queue is above the low-water mark or
while the socket's write buffer is over asyncio's high-water mark, but no longer than
``write_timeout_s`` without progress: then the stream is reset (a peer that stops reading
must not hold its stream and quota forever).

Connections are capped in all (``max_connections``) and per peer address
(``max_connections_per_peer``) by the process's :class:`PeerLedger`; one over a cap is
closed at once, before a byte is read.

A connection is given a :class:`ConnectionContext` (the application as a
:class:`StreamHandler`, the limits, the peer ledger, the body budget, the metrics and the
drain flag), never the server: what it may touch is that list.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import re
from typing import Any, Callable, Protocol, Sequence

from zerolayer.contract import H2_CANCEL
from zerolayer.runtime.serving.channel import Channel
from zerolayer.runtime.limits import BodyBudget, Limits
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.protocol.events import (Accept, ConnectionEnded, Event, Reject, RequestHead, RequestReady,
                                               StreamAborted, stream_key)
from zerolayer.runtime.protocol.h1conn import H1ServerCore
from zerolayer.runtime.protocol.h2conn import PREFACE, H2ServerCore

log = logging.getLogger(__name__)
_ids = itertools.count(1)

LINGER_S = 1.0  # how long a closed connection keeps reading (and dropping) before the socket goes
# Unsent bytes past which a streamed piece is written at once rather than with the loop iteration's
# other output (asyncio's default write high-water mark, so pause_writing is reached as soon as before).
FLUSH_BYTES = 65536


_HTTP1_REQUEST_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+ \S+ HTTP/1\.[01]\r?\n")
_MAX_SNIFF = 8192


def sniff_protocol(first: bytes) -> str | None:
    """``"2"``, ``"1.1"`` or None (need more bytes) from a cleartext connection's first bytes.

    HTTP/2 with prior knowledge starts with the preface. Anything else is HTTP/1.1 only if its
    first line is a request line; other garbage goes to the HTTP/2 core, which rejects the
    preface and closes the connection as RFC 9113 §3.4 asks (instead of an HTTP/1.1 400).
    """
    if first.startswith(PREFACE):
        return "2"
    if PREFACE.startswith(first):
        return None
    if _HTTP1_REQUEST_LINE.match(first):
        return "1.1"
    if b"\n" in first or len(first) >= _MAX_SNIFF:
        return "2"
    return None


def h2_core_class(name: str) -> type:
    """The HTTP/2 core ``server.core`` names: the Python core, or the compiled one (imported only then)."""
    if name == "native":
        from zerolayer.runtime.protocol.h2native import NativeH2ServerCore

        return NativeH2ServerCore
    return H2ServerCore


def h1_core_class(name: str) -> type:
    """The HTTP/1.1 core ``server.core`` names: h11's, or the compiled one on llhttp (httptools)."""
    if name == "native":
        from zerolayer.runtime.protocol.h1native import NativeH1ServerCore

        return NativeH1ServerCore
    return H1ServerCore


class StreamGone(ConnectionError):
    """The stream or its connection closed while a response was being written."""


class PeerLedger:
    """Open connections, in all and per peer address, for the caps in :class:`Limits`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = 0
        self.by_peer: collections.Counter[str] = collections.Counter()

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer``; None if admitted, else the name of the cap hit."""
        if self.total >= self.limits.max_connections:
            return "max_connections"
        if self.by_peer[peer] >= self.limits.max_connections_per_peer:
            return "max_connections_per_peer"
        self.total += 1
        self.by_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.total -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


@dataclasses.dataclass(frozen=True)
class ConnectionAge:
    """``server.max_connection_age_s`` and ``server.max_connection_age_grace_s`` (docs/runtime.md, "Connection age").

    A connection older than its age (``max_age_s`` +-``jitter``, drawn once per connection so those opened
    together do not all reconnect together) starts the drain SIGTERM starts (``start_drain``): HTTP/2 finishes
    its open streams, refuses new ones (REFUSED_STREAM) and sends GOAWAY once none is open; HTTP/1.1 puts
    ``connection: close`` on a response not yet begun and closes after the response in progress. A connection
    idle at its age starts that drain at its next request, which is served: closed while idle, it would fail
    that request for a client that does not read an idle connection (httpcore's HTTP/2); until then the idle
    timeout applies as to any. Still open ``grace_s`` after its drain began, it is closed, cutting what still
    runs. A plain HTTP/2 client keeps one connection for ever: this moves it, in time, to a node or API
    process that joined since (gRPC's MAX_CONNECTION_AGE(_GRACE)).
    """

    max_age_s: float
    grace_s: float
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not self.max_age_s > 0 or not self.grace_s >= 0 or not 0 <= self.jitter < 1:
            raise ValueError(f"ConnectionAge: max_age_s > 0, grace_s >= 0, 0 <= jitter < 1; got {self}")

    def draw(self, rng: Callable[[], float] = random.random) -> float:
        """One connection's age limit, uniform in ``max_age_s`` x [1 - jitter, 1 + jitter]."""
        return self.max_age_s * (1.0 + self.jitter * (2.0 * rng() - 1.0))


class StreamHandler(Protocol):
    """What a connection asks of the application (:class:`zerolayer.runtime.serving.app.Application`)."""

    def gate(self, conn_id: int, head: RequestHead, peer: str | None = None) -> Accept | Reject:
        """Admit or refuse a request at its head, before its body is read."""

    async def serve(self, channel: Channel, ready: RequestReady) -> None:
        """Answer one complete request on ``channel``."""

    def attach(self, key: str, task: asyncio.Task[Any]) -> None:
        """The task serving stream ``key`` (cancelled when the stream is preempted)."""

    def stream_aborted(self, key: str) -> None:
        """The peer reset stream ``key``."""

    def connection_lost(self, conn_id: int) -> None:
        """Every stream of connection ``conn_id`` is over."""


@dataclasses.dataclass(eq=False)
class ConnectionContext:
    """Everything a :class:`Connection` may use, shared by every connection of one listener.

    ``connections`` holds the open ones (the server drains and closes them); ``draining()`` says
    whether a new connection starts draining at once (the server is stopping); ``age``, when set,
    drains and then closes each connection past its age (:class:`ConnectionAge`).
    """

    app: StreamHandler
    limits: Limits
    peers: PeerLedger
    body_budget: BodyBudget
    metrics: RuntimeMetrics
    draining: Callable[[], bool] = lambda: False
    connections: set["Connection"] = dataclasses.field(default_factory=set)
    # ``server.core``: the protocol cores connections get, "python" (h2conn, h1conn) or "native" (h2native, h1native).
    server_core: str = "python"
    # Called once when any connection ends, counted or refused at a cap (handoff.HandoffReceiver.ended:
    # the parent's acceptor counts a process's open connections).
    ended: Callable[[], None] = lambda: None
    age: ConnectionAge | None = None  # server.max_connection_age_s: None, connections are never aged


def peer_address(transport: asyncio.BaseTransport) -> str:
    """The peer's address without its port ("" when the socket has none, e.g. a Unix socket)."""
    name = transport.get_extra_info("peername")
    if isinstance(name, (tuple, list)) and name:
        return str(name[0])
    return str(name or "")


class _Channel:
    __slots__ = ("conn", "sid", "key", "head_sent", "ended")

    def __init__(self, conn: "Connection", sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self.key = stream_key(conn.id, sid)
        self.head_sent = False
        self.ended = False

    async def send_head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.head_sent = True
        self.conn.core.send_head(self.sid, status, headers)
        self.conn.flush_soon()  # leaves with the body, or with the next send's immediate flush

    async def send(self, data: bytes) -> None:
        conn = self.conn
        core = conn.core
        if not core.is_open(self.sid):
            raise StreamGone(f"stream {self.key} is closed")
        core.send_data(self.sid, data)
        # The pieces of every stream that sent in this loop iteration leave in one write (a syscall per
        # connection per iteration, not one per token); past FLUSH_BYTES unsent they leave now, so the
        # socket's back-pressure (pause_writing) is seen however fast a producer is.
        if core.pending_bytes >= FLUSH_BYTES:
            conn.flush()
        else:
            conn.flush_soon()
        await conn.wait_writable(self.sid)

    async def end(self, data: bytes = b"") -> None:
        self.ended = True
        self.conn.core.send_data(self.sid, data, end=True)
        self.conn.flush_soon()

    def reset(self, error_code: int) -> None:
        self.ended = True
        self.conn.core.reset(self.sid, error_code)
        self.conn.flush()


class _AgeTimer:
    """One connection's :class:`ConnectionAge`: at its age, drain as on SIGTERM (a connection idle then, at its
    next request); at the grace's end, close. Cancelled when the connection is lost."""

    __slots__ = ("conn", "grace_s", "handle", "waiting")

    def __init__(self, conn: "Connection", age: ConnectionAge, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.grace_s, self.waiting = conn, age.grace_s, False
        self.handle = loop.call_later(age.draw(), self._aged)

    def _aged(self) -> None:
        conn = self.conn
        if conn.closed:
            return
        conn.context.metrics.connections_aged.labels("drain").inc()
        # Idle: wait for the next request instead of closing now. A client that does not read while idle
        # (httpcore over HTTP/2) would write its next request into a closed socket and fail it; that
        # request is served instead, and the drain starts with it (its response carries the signal).
        self.waiting = conn.core is not None and not conn.core.open_streams and not conn.core.draining
        if not self.waiting:
            self.drain()

    def request_taken(self) -> None:
        """A request is ready on the connection: an aged idle one starts its drain now."""
        if self.waiting:
            self.waiting = False
            self.drain()

    def drain(self) -> None:
        self.conn.start_drain()
        if not self.conn.closed:
            self.handle = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over)

    def _grace_over(self) -> None:
        if not self.conn.closed:
            self.conn.context.metrics.connections_aged.labels("grace").inc()
            self.conn.close()

    def cancel(self) -> None:
        self.handle.cancel()


class Connection(asyncio.Protocol):
    def __init__(self, context: ConnectionContext, tls: bool) -> None:
        self.context = context
        self.app = context.app
        self.limits = context.limits
        self.tls = tls
        self.id = next(_ids)
        self.core: Any = None
        self.transport: asyncio.Transport | None = None
        self._sniff = b""
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._paused = False
        self._writable = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self._age_timer: _AgeTimer | None = None  # server.max_connection_age_s (ConnectionAge)
        self._flush_pending = False
        self.closed = False
        self.peer: str | None = None  # counted in the context's PeerLedger while set

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        peer = peer_address(transport)
        refused = self.context.peers.admit(peer)
        if refused is not None:
            # Over a cap: close before reading a byte. Nothing was counted, so nothing to undo.
            self.context.metrics.limit_hits.labels(refused).inc()
            self.closed = True
            transport.close()
            return
        self.peer = peer
        self.context.connections.add(self)
        self.context.metrics.connections_active.inc()
        if self.tls:
            ssl_object = transport.get_extra_info("ssl_object")
            alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
            self._choose("2" if alpn == "h2" else "1.1")
        loop = asyncio.get_running_loop()
        self._opened = loop.time()
        self._timer = loop.create_task(self._keepalive())
        if self.context.age is not None:
            self._age_timer = _AgeTimer(self, self.context.age, loop)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # lingering after our GOAWAY/close: the peer's late bytes are read and dropped
        if self.core is None:
            self._sniff += data
            version = sniff_protocol(self._sniff)
            if version is None:
                return  # not enough bytes to tell yet
            self._choose(version)
            data, self._sniff = self._sniff, b""
        self._handle(self.core.receive(data))
        self._writable.set()  # WINDOW_UPDATEs may have opened windows
        self.flush()  # answers made at HEADERS time (refusals) and control frames leave now

    def eof_received(self) -> bool | None:
        if self.core is not None and self.core.http_version == "1.1":  # either HTTP/1.1 core (server.core)
            self.flush()  # an answer made since the last flush (flush_soon) leaves before the close
            self._handle(self.core.receive(b""))
        return None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self.core is not None:
            self.core.mark_flushed()
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.context.ended()
        if self.peer is None:
            return  # refused at connection_made: never counted, no core
        self.context.peers.release(self.peer)
        self.peer = None
        self.closed = True
        self.context.connections.discard(self)
        self.context.metrics.connections_active.dec()
        if self._timer is not None:
            self._timer.cancel()
        if self._age_timer is not None:
            self._age_timer.cancel()
        if self.core is not None:
            self.core.connection_lost()  # buffered request bodies give their budget back (issue 28.1)
        # Every stream of this connection ends here, including those admitted at HEADERS whose
        # body never came (they have no task yet but hold a reservation).
        self.app.connection_lost(self.id)
        for task in self._tasks.values():
            task.cancel()
        self._writable.set()

    # ------------------------------------------------------------------ driving the core
    def _choose(self, version: str) -> None:
        def gate(head):  # type: ignore[no-untyped-def]
            return self.app.gate(self.id, head, self.peer)

        def on_limit(name: str) -> None:
            self.context.metrics.limit_hits.labels(name).inc()

        name = self.context.server_core
        cls = h2_core_class(name) if version == "2" else h1_core_class(name)
        self.core = cls(gate, self.limits, on_limit=on_limit, budget=self.context.body_budget)
        self.context.metrics.connections.labels("h2" if version == "2" else "http/1.1").inc()
        if self.context.draining():
            self.core.start_drain()
        self.flush()

    def _handle(self, events: list[Event]) -> None:
        loop = asyncio.get_running_loop()
        for event in events:
            if isinstance(event, RequestReady):
                sid = event.head.stream_id
                task = loop.create_task(self._serve(sid, event))
                self._tasks[sid] = task
                self.app.attach(stream_key(self.id, sid), task)
                if self._age_timer is not None:
                    self._age_timer.request_taken()  # an aged idle connection drains from this request on
            elif isinstance(event, StreamAborted):
                self.app.stream_aborted(stream_key(self.id, event.stream_id))
                aborted = self._tasks.pop(event.stream_id, None)
                if aborted is not None:
                    aborted.cancel()
            elif isinstance(event, ConnectionEnded):
                pass  # flush() closes the socket once the core is over

    async def _serve(self, sid: int, ready: RequestReady) -> None:
        channel = _Channel(self, sid)
        try:
            await self.app.serve(channel, ready)
        except StreamGone:
            pass
        except asyncio.CancelledError:
            if self.core is not None and self.core.is_open(sid):
                self.core.reset(sid, H2_CANCEL)
                self.flush()
            raise
        finally:
            self._tasks.pop(sid, None)
            if not self.closed and self.core is not None:
                if not channel.ended and self.core.is_open(sid):
                    self.core.reset(sid, H2_CANCEL)
                self._handle(self.core.resume())  # HTTP/1.1: the next request may be waiting
                self.flush_soon()

    def flush_soon(self) -> None:
        """Flush once the current event-loop iteration's callbacks have run.

        Everything the core produced in the meantime — the answers of every stream that finished
        in this iteration, heads and bodies, streamed pieces included — then leaves in one ``write``: a
        syscall per connection per iteration instead of several per request or one per token. A
        stream's pieces leave at once only past ``FLUSH_BYTES`` unsent (:meth:`_Channel.send`).
        """
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._deferred_flush)

    def _deferred_flush(self) -> None:
        self._flush_pending = False
        self.flush()

    def flush(self) -> None:
        if self.transport is None or self.closed or self.core is None:
            return
        data = self.core.data_to_send()
        if data:
            self.transport.write(data)
        if not self._paused:
            self.core.mark_flushed()
        if self.core.ended:
            self.closed = True
            for task in self._tasks.values():
                task.cancel()
            self._linger_close()

    def _linger_close(self) -> None:
        """Close after the peer could read our last frames (a GOAWAY with its error code).

        Closing a socket whose receive buffer still holds unread bytes makes the kernel send a
        TCP RST, which can overtake the GOAWAY at the peer (seen with h2spec 6.7/4). So: send
        FIN after what is queued, drop whatever still arrives, and close for good a moment later.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            self._abort_unless_lost(self.limits.write_timeout_s)
            return
        try:
            transport.write_eof()
        except OSError:  # the peer is already gone: nothing to linger for
            transport.close()
            return
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        self._abort_unless_lost(LINGER_S + self.limits.write_timeout_s)

    def _abort_unless_lost(self, delay: float) -> None:
        """asyncio's ``close()`` waits for the write buffer to drain before ``connection_lost``: a
        peer that never reads would hold the socket, and its PeerLedger slot, for good. Past
        ``delay`` the unread bytes are dropped (issue 28, item 2)."""
        transport = self.transport

        def abort() -> None:
            if self.peer is not None and transport is not None:  # connection_lost has not run
                self.context.metrics.limit_hits.labels("write_timeout_s").inc()
                transport.abort()

        asyncio.get_running_loop().call_later(delay, abort)

    async def wait_writable(self, sid: int) -> None:
        """Wait until stream ``sid`` may queue more. No progress for ``write_timeout_s`` (the
        stream's backlog did not shrink and the socket did not drain) resets the stream."""
        core = self.core
        if not self.closed and not self._paused and core.is_open(sid) and core.writable(sid):
            return  # the common case, without the clock reads below
        loop = asyncio.get_running_loop()
        timeout = self.limits.write_timeout_s
        deadline = loop.time() + timeout
        backlog, paused = core.backlog(sid), self._paused
        while not self.closed and core.is_open(sid) and (self._paused or not core.writable(sid)):
            self._writable.clear()
            left = deadline - loop.time()
            if left <= 0:
                self.context.metrics.limit_hits.labels("write_timeout_s").inc()
                core.reset(sid, H2_CANCEL)
                self.flush()
                raise StreamGone(f"stream {stream_key(self.id, sid)}: the peer read nothing for {timeout:g} s")
            try:
                await asyncio.wait_for(self._writable.wait(), left)
            except asyncio.TimeoutError:
                continue
            now_backlog = core.backlog(sid)
            if now_backlog < backlog or (paused and not self._paused):
                deadline = loop.time() + timeout  # the peer took something: progress
            backlog, paused = now_backlog, self._paused
        if self.closed or not core.is_open(sid):
            raise StreamGone(f"stream {stream_key(self.id, sid)} closed while writing")

    # ------------------------------------------------------------------ timers and shutdown
    async def _keepalive(self) -> None:
        """PING idle connections; close those idle past the timeout."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        step = min(limits.ping_interval_s, limits.idle_timeout_s, limits.header_timeout_s,
                   limits.body_timeout_s) / 2
        last_ping = loop.time()
        while not self.closed:
            await asyncio.sleep(step)
            core = self.core
            now = loop.time()
            if core is None:
                # Still sniffing: the first bytes count as a request head for the header timeout.
                if now - self._opened > min(limits.idle_timeout_s, limits.header_timeout_s):
                    self.context.metrics.limit_hits.labels("header_timeout_s").inc()
                    self.close()
                continue
            self._handle(core.expire())
            self.flush()
            if self.closed:
                return
            if core.open_streams:
                continue
            idle = now - core.last_activity
            if idle >= limits.idle_timeout_s:
                self.context.metrics.idle_closed.inc()
                self.close()
                return
            if idle >= limits.ping_interval_s and now - last_ping >= limits.ping_interval_s \
                    and core.http_version == "2":  # either HTTP/2 core (server.core)
                core.ping()
                last_ping = now
                self.context.metrics.pings.inc()
                self.flush()

    def start_drain(self) -> None:
        if self.core is None:
            self.close()
            return
        self.core.start_drain()
        self.flush()

    def close(self) -> None:
        if self.closed or self.transport is None:
            return
        if self.core is not None:
            self.core.close()
            self.flush()
        self.closed = True
        self.transport.close()
        self._abort_unless_lost(self.limits.write_timeout_s)
