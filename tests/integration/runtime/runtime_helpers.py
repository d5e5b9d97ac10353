"""Helpers for the runtime's integration tier: a real server on a loopback port.

``start_runtime`` builds a RuntimeServer with the real MicroScheduler and the synthetic
engine (or whatever the test passes). ``H2Client`` is a small raw HTTP/2 client on h2 so
tests can see what SDKs hide: RST_STREAM codes, GOAWAY, flow-control windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any, AsyncIterator

import h2.config
import h2.connection
import h2.events
import h2.settings

from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.serving.server import RuntimeServer
from zerolayer.runtime.tenants import Tenant, key_hash

from zerolayer.contract import Priority

KEY = "sk-acme-test"
LOW_KEY = "sk-low-test"
LIMITED_KEY = "sk-limited-test"


def tenants() -> list[Tenant]:
    return [
        Tenant("acme", frozenset({key_hash(KEY)}), TenantPolicy("acme", tokens_per_minute=10_000_000,
                                                                 requests_per_minute=100_000)),
        Tenant("lowonly", frozenset({key_hash(LOW_KEY)}),
               TenantPolicy("lowonly", allowed_priorities=frozenset({Priority.LOW}))),
        Tenant("limited", frozenset({key_hash(LIMITED_KEY)}), TenantPolicy("limited", requests_per_minute=1)),
    ]


@contextlib.asynccontextmanager
async def start_runtime(**kwargs: Any) -> AsyncIterator[RuntimeServer]:
    kwargs.setdefault("engine", SyntheticEngine())
    kwargs.setdefault("scheduler", MicroScheduler(SchedulerConfig()))
    kwargs.setdefault("tenants", tenants())
    server = RuntimeServer(**kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(drain_timeout_s=2.0)


def chat_body(stream: bool = True, max_tokens: int = 200, model: str = "synthetic") -> bytes:
    return json.dumps({"model": model, "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


@dataclasses.dataclass
class StreamResult:
    status: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytearray = dataclasses.field(default_factory=bytearray)
    ended: bool = False
    reset_code: int | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    got_data: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class H2Client:
    """A raw h2c client: open streams, watch frames. ``auto_window=False`` makes a slow reader."""

    def __init__(self, port: int, *, window: int = 65535, auto_window: bool = True) -> None:
        self.port = port
        self.window = window
        self.auto_window = auto_window
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.streams: dict[int, StreamResult] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.goaway_seen = asyncio.Event()
        self.closed = asyncio.Event()

    async def __aenter__(self) -> "H2Client":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window})
        self.conn.initiate_connection()
        await self.flush()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def request(self, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                      method: str = "POST") -> int:
        sid = self.conn.get_next_available_stream_id()
        head = [(":method", method), (":path", path), (":scheme", "http"), (":authority", "test")]
        head += [(k, v) for k, v in (headers or {}).items()]
        self.streams[sid] = StreamResult()
        self.conn.send_headers(sid, head, end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)
        await self.flush()
        return sid

    async def _read(self) -> None:
        while True:
            data = await self.reader.read(65536)
            if not data:
                self.closed.set()
                for result in self.streams.values():
                    result.done.set()
                return
            for event in self.conn.receive_data(data):
                self._on(event)
            await self.flush()

    def _on(self, event: h2.events.Event) -> None:
        sid = getattr(event, "stream_id", None)
        result = self.streams.get(sid) if sid else None
        if isinstance(event, h2.events.ResponseReceived) and result:
            result.headers = dict(event.headers)
            result.status = int(result.headers[":status"])
        elif isinstance(event, h2.events.DataReceived) and result:
            result.body += event.data
            result.got_data.set()
            if self.auto_window:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded) and result:
            result.ended = True
            result.done.set()
        elif isinstance(event, h2.events.StreamReset) and result:
            result.reset_code = event.error_code
            result.done.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
            self.goaway_seen.set()
            if event.error_code == 0:
                # h2 treats any GOAWAY as the end of the connection, while RFC 9113 §6.8 lets streams
                # up to last_stream_id finish (curl/nghttp2 and Go do). Keep receiving, as they would.
                self.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN

    def read_more(self, sid: int, amount: int) -> None:
        """Open the windows by ``amount`` (a slow reader taking a sip)."""
        self.conn.increment_flow_control_window(amount)
        self.conn.increment_flow_control_window(amount, stream_id=sid)


def sse_events(body: bytes) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((name, json.loads(data) if data not in (None, "[DONE]") else data))
    return out


