"""Helpers for the regression tier: the real transport and application on a fake socket.

Nothing of ours is faked: :func:`runtime` builds a :class:`RuntimeServer` (real Application,
MicroScheduler, TenantDirectory) on the synthetic engine without opening a listener, and
:class:`Peer` drives one :class:`~zerolayer.runtime.serving.transport.Connection` through a
:class:`FakeSocket` that behaves like asyncio's socket transport: ``close()`` schedules
``connection_lost`` on the next loop iteration, a peer's FIN goes through ``eof_received``
first, and ``pause_writing``/``resume_writing`` model a peer that stops reading.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

import h2.config
import h2.connection
import h2.events

from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.serving.server import RuntimeServer
from zerolayer.runtime.tenants import Tenant, key_hash
from zerolayer.runtime.serving.transport import Connection

KEY = "sk-regression-acme"


def tenants(max_concurrent_streams: int | None = None) -> list[Tenant]:
    return [Tenant("acme", frozenset({key_hash(KEY)}),
                   TenantPolicy("acme", max_concurrent_streams=max_concurrent_streams))]


async def runtime(*, limits: Limits | None = None, max_concurrent_streams: int | None = None,
                  engine: Any = None, **kwargs: Any) -> RuntimeServer:
    """A RuntimeServer whose engine is started and whose tenants are applied; no listener."""
    server = RuntimeServer(engine=engine or SyntheticEngine(output_tokens=200, tokens_per_second=50),
                           scheduler=MicroScheduler(SchedulerConfig()),
                           tenants=tenants(max_concurrent_streams), limits=limits or Limits(), **kwargs)
    await server.engine.start()
    server.scheduler.set_tenants(server.tenants.policies())
    return server


class FakeSocket:
    """The slice of ``asyncio.Transport`` that Connection uses, recording what is written."""

    def __init__(self, peer: tuple[str, int] = ("10.0.0.7", 40000), high_water: int | None = None) -> None:
        self.protocol: Connection | None = None
        self.high_water = high_water  # like a socket buffer: pause_writing() above it until take()
        self.paused = False
        self.written = bytearray()
        self.closing = False
        self.lost = False
        self.eof_written = False
        self.peer = peer
        # Like asyncio's selector transport: close() with unread bytes still buffered waits for them
        # to drain before connection_lost; a peer that never reads holds it until abort().
        self.holds_unread = False

    def write(self, data: bytes) -> None:
        if not self.closing:
            self.written += data
        if self.high_water is not None and len(self.written) > self.high_water and not self.paused:
            self.paused = True
            assert self.protocol is not None
            self.protocol.pause_writing()

    def take(self) -> bytes:
        data = bytes(self.written)
        self.written.clear()
        if self.paused and self.protocol is not None:
            self.paused = False
            self.protocol.resume_writing()
        return data

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        """As asyncio does: connection_lost runs on the next loop iteration, once."""
        if self.closing:
            return
        self.closing = True
        if self.holds_unread and self.paused:
            return  # connection_lost only once the peer reads (take()) or on abort()
        asyncio.get_running_loop().call_soon(self._lost)

    def abort(self) -> None:
        """As asyncio does: drop the buffer, connection_lost on the next iteration."""
        self.closing = True
        asyncio.get_running_loop().call_soon(self._lost)

    def _lost(self) -> None:
        if not self.lost and self.protocol is not None:
            self.lost = True
            self.protocol.connection_lost(None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "ssl_object": None}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connect(server: RuntimeServer, peer: tuple[str, int] = ("10.0.0.7", 40000),
            high_water: int | None = None) -> tuple[Connection, FakeSocket]:
    sock = FakeSocket(peer, high_water)
    conn = Connection(server.context, tls=False)
    sock.protocol = conn
    conn.connection_made(sock)  # type: ignore[arg-type]
    return conn, sock


def peer_closes(conn: Connection, sock: FakeSocket) -> None:
    """The peer's FIN, handled the way asyncio's selector transport handles it."""
    if not conn.eof_received():
        sock.close()


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


def chat_body(stream: bool = True, max_tokens: int = 200, **extra: Any) -> bytes:
    return json.dumps({"model": "synthetic", "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "hello"}], **extra}).encode()


def h1_request(body: bytes, path: str = "/v1/messages", key: str = KEY,
               extra: Sequence[tuple[str, str]] = ()) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: node", "content-type: application/json",
             f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in extra)]
    if key:
        lines.append(f"x-api-key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class H2Peer:
    """An h2 client whose bytes go straight into a Connection."""

    def __init__(self, conn: Connection, sock: FakeSocket) -> None:
        self.conn, self.sock = conn, sock
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.flush()
        self.read()  # the server's SETTINGS (its windows and frame size)

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.conn.data_received(data)

    def read(self) -> list[h2.events.Event]:
        """Take what the server wrote and feed it to the client (acknowledging DATA)."""
        events = self.h2.receive_data(self.sock.take()) if self.sock.written else []
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.events += events
        self.flush()
        return events

    def request(self, body: bytes | None, path: str = "/v1/messages", key: str | None = KEY,
                extra: Sequence[tuple[str, str]] = (), end: bool = True) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST" if body is not None else "GET"), (":path", path), (":scheme", "http"),
                   (":authority", "node"), ("content-type", "application/json"), *extra]
        if key:
            headers.append(("x-api-key", key))
        self.h2.send_headers(sid, headers, end_stream=body is None or (end and not body))
        step = self.h2.max_outbound_frame_size
        for at in range(0, len(body or b""), step):
            assert body is not None
            self.h2.send_data(sid, body[at:at + step], end_stream=end and at + step >= len(body))
        self.flush()
        return sid

    def status(self, sid: int) -> int | None:
        for event in self.events:
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                return int(dict(event.headers)[":status"])
        return None

    def headers(self, sid: int) -> dict[str, str]:
        for event in self.events:
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                return dict(event.headers)
        return {}

    def body(self, sid: int) -> bytes:
        return b"".join(e.data for e in self.events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)

    def reset_code(self, sid: int) -> int | None:
        for event in self.events:
            if isinstance(event, h2.events.StreamReset) and event.stream_id == sid:
                return event.error_code
        return None

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        for event in self.events:
            if isinstance(event, h2.events.ConnectionTerminated):
                return event
        return None


def limits(**values: Any) -> Limits:
    """Limits with ``values``; a field this version of Limits lacks is left out, so a test written
    for a new knob still runs (and fails on behaviour, not on a TypeError) against older code."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(Limits)}
    return Limits(**{k: v for k, v in values.items() if k in known})
