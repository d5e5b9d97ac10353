"""A small HTTP/2 load client on the sans-IO ``h2`` library, for the scheduler's load tests.

Why not httpx: under load the runtime refuses many streams at HEADERS time (RFC 9113
§8.1: a complete response, then RST_STREAM(NO_ERROR) so the client stops sending its body)
and httpcore then fails the request with a ``LocalProtocolError`` while still writing the
body, losing the 429/529 the server sent. This client keeps the response it got, treats
the body write to an already-closed stream as the server's choice, and records per
stream what a streaming caller sees: status, headers, time to first token (first
``content_block_delta`` SSE event), the SSE error code and any RST_STREAM code.
One connection, many concurrent streams (bounded by the server's SETTINGS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


@dataclasses.dataclass
class H2Result:
    status: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytearray = dataclasses.field(default_factory=bytearray)
    reset_code: int | None = None
    started: float = 0.0
    ttft_s: float | None = None
    total_s: float | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def events(self) -> list[str]:
        return [line[7:] for line in self.body.decode(errors="replace").splitlines() if line.startswith("event: ")]

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.reset_code is None and "message_stop" in self.events

    @property
    def error_message(self) -> str:
        """The JSON error body's message (responses that are not 200), else ''."""
        if self.status is None or self.status == 200:
            return ""
        try:
            return str(json.loads(self.body.decode(errors="replace"))["error"].get("message", ""))
        except (ValueError, KeyError):
            return ""

    @property
    def error_code(self) -> str | None:
        text = self.body.decode(errors="replace")
        if self.status is not None and self.status != 200:
            try:
                return json.loads(text)["error"].get("code")
            except (ValueError, KeyError):
                return None
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line == "event: error" and i + 1 < len(lines) and lines[i + 1].startswith("data: "):
                return json.loads(lines[i + 1][6:])["error"].get("code")
        return None


class H2LoadClient:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._streams: dict[int, H2Result] = {}
        self._reader_task: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "H2LoadClient":
        reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(2**30)
        self._flush()
        self._reader_task = asyncio.create_task(self._read(reader))
        self._slots = asyncio.Semaphore(100)  # under the server's SETTINGS_MAX_CONCURRENT_STREAMS
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except asyncio.CancelledError:
                pass
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass

    async def request(self, path: str, headers: dict[str, str], body: bytes, method: str = "POST") -> H2Result:
        assert self._slots is not None
        async with self._slots:
            result = H2Result(started=time.monotonic())
            sid = self._conn.get_next_available_stream_id()
            self._streams[sid] = result
            self._conn.send_headers(sid, [(":method", method), (":path", path), (":scheme", "http"),
                                          (":authority", f"{self.host}:{self.port}"),
                                          ("content-type", "application/json"),
                                          ("content-length", str(len(body))), *headers.items()])
            try:
                self._conn.send_data(sid, body, end_stream=True)
            except h2.exceptions.StreamClosedError:
                pass  # the server answered at HEADERS time and closed the stream: its response stands
            self._flush()
            await result.done.wait()
            result.total_s = time.monotonic() - result.started
            return result

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and self._writer is not None:
            self._writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                for result in self._streams.values():
                    result.done.set()
                return
            for event in self._conn.receive_data(data):
                result = self._streams.get(getattr(event, "stream_id", 0) or 0)
                if isinstance(event, h2.events.ResponseReceived) and result:
                    headers = dict(event.headers)
                    result.status = int(headers.pop(":status"))
                    result.headers = headers
                elif isinstance(event, h2.events.DataReceived):
                    self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if result:
                        result.body += event.data
                        if result.ttft_s is None and b"event: content_block_delta" in event.data:
                            result.ttft_s = time.monotonic() - result.started
                elif isinstance(event, h2.events.StreamEnded) and result:
                    self._streams.pop(event.stream_id, None)
                    result.done.set()
                elif isinstance(event, h2.events.StreamReset) and result:
                    self._streams.pop(event.stream_id, None)
                    result.reset_code = int(event.error_code)
                    result.done.set()
                elif isinstance(event, h2.events.ConnectionTerminated):
                    for pending in self._streams.values():
                        pending.done.set()
            self._flush()
