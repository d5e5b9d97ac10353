"""A real HTTP/2 server (h2 on asyncio sockets) that speaks enough of /v1/messages to
test the SDK against, and injects faults on request.

It is a test *peer*, not a mock of our code: the SDK under test opens real TCP
connections, negotiates HTTP/2 (prior knowledge) and receives real frames, including
RST_STREAM and GOAWAY. It runs its own event loop in a thread so blocking and asyncio
clients can both use it.

Each request is answered by ``handler(request) -> action``; :meth:`H2Peer.script` queues
actions for the next requests. Actions: :class:`Respond`, :class:`Stream`,
:class:`Reset`, :class:`Kill`, :class:`GoAway`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any, Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclasses.dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int
    stream_id: int

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclasses.dataclass
class Respond:
    status: int = 200
    body: Any = None  # dict -> JSON; bytes/str sent as is
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    delay_s: float = 0.0


@dataclasses.dataclass
class Reset:
    """RST_STREAM with ``code``; as a Stream's ``then``, sent after the events."""

    code: int


@dataclasses.dataclass
class Kill:
    """Abort the TCP connection (no GOAWAY): every stream on it is lost."""


@dataclasses.dataclass
class GoAway:
    code: int = 0
    last_stream_id: int | None = None


@dataclasses.dataclass
class Stream:
    """200 + SSE events, then end the stream, or ``then`` = Reset(code) / Kill()."""

    events: list[tuple[str, dict]]
    then: Reset | Kill | None = None
    delay_s: float = 0.0  # between events
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


Action = Respond | Stream | Reset | Kill | GoAway


# --------------------------------------------------------------------------- message builders
def message_json(req: Request, text: str = "hello world") -> dict:
    body = req.json or {}
    words = text.split()[: body.get("max_tokens", 16)]
    return {
        "id": f"msg_{req.connection}_{req.stream_id}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "tiny"),
        "content": [{"type": "text", "text": " ".join(words)}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": len(words)},
    }


def sse_events(req: Request, tokens: list[str] | None = None) -> list[tuple[str, dict]]:
    body = req.json or {}
    tokens = tokens if tokens is not None else ["hello", " world"][: body.get("max_tokens", 16)]
    events: list[tuple[str, dict]] = [
        ("message_start", {"type": "message_start", "message": {"id": "msg", "type": "message", "role": "assistant",
                                                               "content": [], "model": body.get("model", "tiny"),
                                                               "usage": {"input_tokens": 3, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ]  # fmt: skip
    for tok in tokens:
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": tok}})
        )
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": len(tokens)}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return events


def error_body(code: str, message: str = "injected", etype: str = "api_error") -> dict:
    return {"type": "error", "error": {"type": etype, "message": message, "code": code}}


def default_handler(req: Request) -> Action:
    body = req.json or {}
    if body.get("stream"):
        return Stream(sse_events(req))
    return Respond(200, message_json(req))


# --------------------------------------------------------------------------- the server
class H2Peer:
    def __init__(self, handler: Callable[[Request], Action] | None = None) -> None:
        self.handler = handler or default_handler
        self.requests: list[Request] = []
        self.connections = 0
        self.max_concurrent_streams = 0  # most streams open at once on one connection
        self._queue: list[Action] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="h2peer", daemon=True)
        self.port = 0

    # --- control (from the test's thread) ---------------------------------------------
    def start(self, port: int = 0) -> "H2Peer":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", port), self._loop
        ).result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *actions: Action) -> None:
        """Answer the next requests with these actions, in order, then with the handler."""
        with self._lock:
            self._queue.extend(actions)

    def stop(self) -> None:
        """Close the listening socket and abort every connection (a dead node)."""

        async def _stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(5)

    def close(self) -> None:
        self.stop()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    # --- protocol ---------------------------------------------------------------------
    def _next_action(self, req: Request) -> Action:
        with self._lock:
            self.requests.append(req)
            if self._queue:
                action = self._queue.pop(0)
                return action(req) if callable(action) else action
        return self.handler(req)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_id = self.connections
        self._writers.add(writer)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        partial: dict[int, tuple[dict[str, str], bytearray]] = {}
        open_streams: set[int] = set()
        window = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    break
                for event in events:
                    if isinstance(event, h2.events.RequestReceived):
                        partial[event.stream_id] = (dict(event.headers), bytearray())
                        open_streams.add(event.stream_id)
                        self.max_concurrent_streams = max(self.max_concurrent_streams, len(open_streams))
                    elif isinstance(event, h2.events.DataReceived):
                        partial[event.stream_id][1].extend(event.data)
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id in partial:
                        headers, body = partial.pop(event.stream_id)
                        req = Request(headers[":method"], headers[":path"], headers, bytes(body), conn_id, event.stream_id)
                        task = asyncio.ensure_future(self._serve(conn, writer, req, window, open_streams))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    elif isinstance(event, h2.events.StreamReset):
                        open_streams.discard(event.stream_id)
                    elif isinstance(event, h2.events.WindowUpdated):
                        window.set()
                writer.write(conn.data_to_send())
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            self._writers.discard(writer)
            writer.transport.abort()

    async def _send(self, conn, writer, stream_id: int, data: bytes, window: asyncio.Event, end: bool = False) -> None:
        while data:
            while conn.local_flow_control_window(stream_id) < 1:
                window.clear()
                await window.wait()
            size = min(len(data), conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
            chunk, data = data[:size], data[size:]
            conn.send_data(stream_id, chunk, end_stream=end and not data)
            writer.write(conn.data_to_send())

    async def _serve(self, conn, writer, req: Request, window: asyncio.Event, open_streams: set[int]) -> None:
        sid = req.stream_id
        action = self._next_action(req)
        try:
            if isinstance(action, Respond):
                if action.delay_s:
                    await asyncio.sleep(action.delay_s)
                body = action.body
                payload = json.dumps(body).encode() if isinstance(body, (dict, list)) else (body or b"")
                payload = payload.encode() if isinstance(payload, str) else payload
                headers = {"content-type": "application/json", "x-request-id": f"req-{req.connection}-{sid}", **action.headers}
                conn.send_headers(sid, [(":status", str(action.status)), *headers.items()], end_stream=not payload)
                writer.write(conn.data_to_send())
                if payload:
                    await self._send(conn, writer, sid, payload, window, end=True)
            elif isinstance(action, Stream):
                headers = {"content-type": "text/event-stream", "x-request-id": f"req-{req.connection}-{sid}", **action.headers}
                conn.send_headers(sid, [(":status", "200"), *headers.items()])
                writer.write(conn.data_to_send())
                for name, data in action.events:
                    frame = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                    await self._send(conn, writer, sid, frame, window)
                    await writer.drain()
                    if action.delay_s:
                        await asyncio.sleep(action.delay_s)
                if isinstance(action.then, Reset):
                    conn.reset_stream(sid, action.then.code)
                elif isinstance(action.then, Kill):
                    writer.transport.abort()
                    return
                else:
                    conn.end_stream(sid)
                writer.write(conn.data_to_send())
            elif isinstance(action, Reset):
                conn.reset_stream(sid, action.code)
                writer.write(conn.data_to_send())
            elif isinstance(action, Kill):
                writer.transport.abort()
                return
            elif isinstance(action, GoAway):
                last = action.last_stream_id if action.last_stream_id is not None else sid
                conn.close_connection(action.code, last_stream_id=last)
                writer.write(conn.data_to_send())
                await writer.drain()
                writer.close()
                return
            await writer.drain()
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass  # the client reset or went away: nothing to deliver to
        finally:
            open_streams.discard(sid)
