"""Sans-IO HTTP/2 server connection on python-hyper ``h2``.

Bytes in (:meth:`H2ServerCore.receive`), events out, bytes to write out
(:meth:`H2ServerCore.data_to_send`). No sockets, no clocks of its own (``clock`` is
injected), no asyncio: the transport in :mod:`zerolayer.runtime.serving.transport` drives it
and tests drive it with frames built by hyperframe/h2.

What this layer adds to h2, which has almost no hardening of its own:

* the *gate*: each request is accepted or rejected when its HEADERS complete, before
  any DATA is buffered; a rejected stream's body is acknowledged for flow control and
  dropped;
* per-stream outbound queues bounded by flow control, so a slow reader stalls only its
  own producer (``backlog`` / ``writable``);
* limits from :class:`zerolayer.runtime.limits.Limits`: rapid reset budget, CONTINUATION
  frame count, queued control-frame answers, empty-frame and WINDOW_UPDATE floods,
  header list size and count, body size, bytes of bodies buffered at once (a
  :class:`~zerolayer.runtime.limits.BodyBudget` shared by the process); each trip calls
  ``on_limit(name)``;
* slow peers (:meth:`H2ServerCore.expire`, called by the transport's timer): a header block
  left incomplete past ``header_timeout_s`` ends the connection; a body not complete within
  ``body_timeout_s`` of its HEADERS is answered 408 and reset; a rejected stream is forgotten
  (reset) by then too, so an unanswered peer cannot hold streams or the connection open;
* a gate that raises answers 500 on that stream only;
* graceful drain (:meth:`H2ServerCore.start_drain`), see below.

Graceful drain, and why its GOAWAY comes last
---------------------------------------------
A draining connection finishes the streams it has and takes no new ones. While any stream is
still open, each new stream is answered RST_STREAM(REFUSED_STREAM): never started, so every
client may retry it (RFC 9113 §8.7); Go's and curl's HTTP/2 clients retry it on their own and the
SDK reads it as a not-processed ``StreamRefused`` and retries on another node. GOAWAY(NO_ERROR,
last stream id = the highest stream taken) is sent only when the last open stream ends (its
response complete, or reset by either side), or at the drain deadline when the server closes the
connection; then the connection ends. A connection
with no open stream gets its GOAWAY at once.

RFC 9113 §6.8 has a server that is shutting down gracefully send GOAWAY first and finish the
streams at or below its last stream id; that initial GOAWAY is a SHOULD, not a MUST, and the
refusals say the same thing stream by stream. We do not send it early because a GOAWAY cuts
the open streams of common clients: httpcore 1.0.9 (under httpx, so under zerolayer's own SDK
and the official Python SDKs in HTTP/2 mode) raises on every stream still reading once any
GOAWAY has arrived, whatever its last stream id (encode/httpcore#730). The cost: a client that
keeps opening streams on a draining connection is refused once per request until the
connection's open streams have ended, instead of learning from one GOAWAY to open a new
connection.
"""

from __future__ import annotations

import collections
import logging

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
from hyperframe.frame import (
    AltSvcFrame, ContinuationFrame, DataFrame, ExtensionFrame, HeadersFrame, PingFrame,
    PriorityFrame, SettingsFrame, WindowUpdateFrame)

from zerolayer.contract import H2_CANCEL, H2_ENHANCE_YOUR_CALM, H2_NO_ERROR, H2_REFUSED_STREAM
from zerolayer.runtime.limits import TokenBucket
from zerolayer.runtime.protocol.core import ServerCore
from zerolayer.runtime.protocol.events import (
    Accept, ConnectionEnded, Event, Reject, RequestHead, RequestReady, StreamAborted)

log = logging.getLogger(__name__)
H2_PROTOCOL_ERROR = 0x1
GATE_FAILED = Reject(500, [("content-type", "text/plain")], b"internal error\n")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class _Flood(h2.exceptions.ProtocolError):
    """Raised inside h2's frame loop so h2 itself answers GOAWAY(ENHANCE_YOUR_CALM)."""

    error_code = h2.errors.ErrorCodes(H2_ENHANCE_YOUR_CALM)

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class _GuardedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer with a look at every inbound frame before h2 acts on it."""

    def __init__(self, core: "H2ServerCore") -> None:
        super().__init__(server=True)
        self._core = core

    # h2 calls this exactly once per parsed frame (its __next__ recurses, so hook here, not there).
    def _update_header_buffer(self, f):  # type: ignore[no-untyped-def]
        if f is not None:
            self._core._inspect(f)
        if self._headers_buffer and isinstance(f, ContinuationFrame):
            if len(self._headers_buffer) >= self._core.limits.max_continuation_frames:
                raise _Flood("max_continuation_frames", "too many CONTINUATION frames in one header block")
        return super()._update_header_buffer(f)


class _Stream:
    __slots__ = (
        "head", "accepted", "context", "max_body", "body", "remote_ended",
        "out", "out_bytes", "end_pending", "local_ended", "rejected", "discarded",
        "opened", "owner", "stop_reading", "stalled_since",
    )

    def __init__(self, head: RequestHead, opened: float) -> None:
        self.head = head
        self.opened = opened  # when its HEADERS completed: the body timeout counts from here
        self.owner: str | None = None  # whose BodyBudget the buffered body is booked to
        self.stop_reading = False  # reset (NO_ERROR) once our response has ended
        self.accepted = False
        self.rejected = False
        self.discarded = 0
        self.context = None
        self.max_body = 0
        self.body = bytearray()
        self.remote_ended = head.end_stream
        self.out: collections.deque[bytes] = collections.deque()
        self.out_bytes = 0
        self.end_pending = False
        self.local_ended = False
        # Since when queued output (or its END_STREAM) has waited for the peer's window with no
        # DATA leaving: past ``write_timeout_s`` the stream is reset (issue 28, item 2).
        self.stalled_since: float | None = None


class H2ServerCore(ServerCore):
    """One server-side HTTP/2 connection, sans I/O.

    ``gate(head)`` is called once per request when its header block is complete and must
    not block. ``on_limit(name)`` is called each time a hardening limit trips.
    """

    http_version = "2"

    def _open(self, now: float) -> None:
        self._block_since: float | None = None  # a header block (HEADERS + CONTINUATIONs) is open
        self._resets = TokenBucket(self.limits.rapid_reset_burst, self.limits.rapid_reset_per_second, now)
        self._empty = TokenBucket(self.limits.empty_frames_burst, self.limits.empty_frames_per_second, now)
        self._window_updates = TokenBucket(self.limits.window_update_burst, self.limits.window_update_per_second, now)
        self._ignored = TokenBucket(self.limits.ignored_frames_burst, self.limits.ignored_frames_per_second, now)
        self._queued_control = 0
        self._streams: dict[int, _Stream] = {}
        self._drain_last_stream = 0

        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self._conn = h2.connection.H2Connection(config=config)
        self._conn.incoming_buffer = _GuardedFrameBuffer(self)
        self._conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self.limits.max_header_list_size,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.limits.initial_window_size,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: self.limits.max_frame_size,
            },
        )
        # hpack only learns the setting once the peer ACKs it; enforce it from the first byte.
        self._conn.decoder.max_header_list_size = self.limits.max_header_list_size
        self._conn.initiate_connection()
        extra = self.limits.initial_window_size - 65535
        if extra > 0:
            self._conn.increment_flow_control_window(extra)
        self._pull()

    # ------------------------------------------------------------------ inbound
    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete."""
        if self.ended:
            return []
        out: list[Event] = []
        try:
            h2_events = self._conn.receive_data(data)
        except _Flood as exc:
            self.on_limit(exc.limit)
            return self._end(out, H2_ENHANCE_YOUR_CALM, str(exc))
        except h2.exceptions.DenialOfServiceError as exc:
            self.on_limit("max_header_list_size")
            return self._end(out, H2_ENHANCE_YOUR_CALM, str(exc))
        except h2.exceptions.ProtocolError as exc:
            return self._end(out, getattr(exc, "error_code", H2_PROTOCOL_ERROR) or H2_PROTOCOL_ERROR, str(exc))
        for event in h2_events:
            if self.ended:
                break
            self._dispatch(event, out)
        self._pull()
        return out

    def resume(self) -> list[Event]:
        """HTTP/2 multiplexes: nothing waits on a previous response."""
        return []

    def _inspect(self, frame) -> None:  # type: ignore[no-untyped-def]
        """Called by the frame buffer for each parsed frame, before h2 handles it."""
        now = self.clock()
        if isinstance(frame, (PingFrame, SettingsFrame)) and "ACK" not in frame.flags:
            self._queued_control += 1
            if self._queued_control > self.limits.max_queued_control_frames:
                raise _Flood("max_queued_control_frames", "too many PING/SETTINGS answers queued unread")
        elif isinstance(frame, (PingFrame, SettingsFrame, PriorityFrame, ExtensionFrame, AltSvcFrame)):
            # ACKs, PRIORITY and frames of unknown type cost us parsing and nothing answers them,
            # so no other budget sees them: their own, or a peer could send them forever.
            if not self._ignored.take(now):
                raise _Flood("ignored_frames_burst", "flood of PRIORITY, ACK or unknown frames")
        elif isinstance(frame, WindowUpdateFrame):
            if not self._window_updates.take(now):
                raise _Flood("window_update_burst", "WINDOW_UPDATE flood")
        elif isinstance(frame, (DataFrame, HeadersFrame, ContinuationFrame)):
            empty = not frame.data and "END_STREAM" not in frame.flags
            if isinstance(frame, (HeadersFrame, ContinuationFrame)):
                empty = empty and "END_HEADERS" not in frame.flags
                # The header timeout counts from the first frame of a block to its END_HEADERS.
                if "END_HEADERS" in frame.flags:
                    self._block_since = None
                elif self._block_since is None:
                    self._block_since = now
            if empty and not self._empty.take(now):
                raise _Flood("empty_frames_burst", "flood of empty frames")

    def _dispatch(self, event, out: list[Event]) -> None:  # type: ignore[no-untyped-def]
        if isinstance(event, h2.events.RequestReceived):
            self._on_request(event, out)
        elif isinstance(event, h2.events.DataReceived):
            self._on_data(event, out)
        elif isinstance(event, h2.events.StreamEnded):
            self._on_stream_ended(event.stream_id, out)
        elif isinstance(event, h2.events.StreamReset):
            self._on_reset(event, out)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._flush_all()
        elif isinstance(event, h2.events.ConnectionTerminated):
            # Nothing more will be read: every buffered body gives its budget back now (h2 is
            # already CLOSED, so _end sends no GOAWAY of ours).
            self._end(out, event.error_code or 0, "peer sent GOAWAY")
        elif isinstance(event, h2.events.TrailersReceived) and event.stream_ended is not None:
            self._on_stream_ended(event.stream_id, out)

    def _on_request(self, event: h2.events.RequestReceived, out: list[Event]) -> None:
        sid = event.stream_id
        # Activity means requests and their data: PING ACKs and WINDOW_UPDATEs don't keep a connection alive.
        self.last_activity = self.clock()
        if self.draining and sid > self._drain_last_stream:
            self._conn.reset_stream(sid, H2_REFUSED_STREAM)
            return
        pseudo: dict[str, str] = {}
        headers: dict[str, str] = {}
        count = 0
        for name_b, value_b in event.headers:
            name = name_b.decode("latin-1") if isinstance(name_b, bytes) else name_b
            value = value_b.decode("latin-1") if isinstance(value_b, bytes) else value_b
            if name.startswith(":"):
                pseudo[name] = value
                continue
            count += 1
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        head = RequestHead(
            stream_id=sid,
            method=pseudo.get(":method", ""),
            path=pseudo.get(":path", ""),
            headers=headers,
            authority=pseudo.get(":authority", headers.get("host", "")),
            end_stream=event.stream_ended is not None,
        )
        stream = _Stream(head, self.last_activity)
        self._streams[sid] = stream
        if count > self.limits.max_header_count:
            self.on_limit("max_header_count")
            verdict: Accept | Reject = Reject(431, [("content-type", "text/plain")], b"too many header fields\n")
        else:
            try:
                verdict = self.gate(head)
            except Exception:  # a bug in the gate costs this stream, not the connection's others
                log.exception("gate failed on stream %d", sid)
                verdict = GATE_FAILED
        if isinstance(verdict, Reject):
            self._reject(stream, verdict)
            return
        stream.accepted = True
        stream.context = verdict.context
        stream.max_body = verdict.max_body
        stream.owner = verdict.owner
        # A HEADERS frame with END_STREAM also yields h2's StreamEnded: RequestReady comes from there.

    def _reject(self, stream: _Stream, verdict: Reject) -> None:
        stream.rejected = True
        self.send_head(stream.head.stream_id, verdict.status, verdict.headers)
        self.send_data(stream.head.stream_id, verdict.body, end=True)

    def _on_data(self, event: h2.events.DataReceived, out: list[Event]) -> None:
        sid = event.stream_id
        stream = self._streams.get(sid)
        self.last_activity = self.clock()
        # Flow control is credited back at once in every case: the body is bounded by max_body.
        if event.flow_controlled_length:
            self._conn.acknowledge_received_data(event.flow_controlled_length, sid)
        if stream is None or not stream.accepted:
            self.discarded_body_bytes += len(event.data)
            if stream is not None:
                stream.discarded += len(event.data)
                if stream.discarded > self.limits.max_body_bytes and stream.local_ended:
                    # Still sending a body nobody will read: ask it to stop (RFC 9113 §8.1).
                    try:
                        self._conn.reset_stream(sid, H2_NO_ERROR)
                    except h2.exceptions.H2Error:
                        pass  # its END_STREAM came in the same read: h2 has closed it already
                    self._forget(sid)
            return
        if len(stream.body) + len(event.data) > stream.max_body:
            self.on_limit("max_body_bytes")
            self.discarded_body_bytes += len(event.data)
            self._refuse_body(stream, Reject(413, [("content-type", "text/plain")], b"request body too large\n"), out)
            return
        refused = self.budget.take(stream.owner, len(event.data))
        if refused is not None:
            # Too many bodies buffered at once (in the process or for this tenant): this one waits
            # elsewhere. Answered like a busy node, so the client may retry later.
            self.on_limit(refused)
            self.discarded_body_bytes += len(event.data)
            self._refuse_body(stream, Reject(503, [("content-type", "text/plain"), ("retry-after", "1")],
                                             b"too many request bodies buffered; retry later\n"), out)
            return
        stream.body += event.data

    def _on_stream_ended(self, sid: int, out: list[Event]) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            return
        stream.remote_ended = True
        if stream.accepted:
            out.append(RequestReady(stream.head, bytes(stream.body), stream.context))
            self._drop_body(stream)
        self._maybe_forget(stream)

    def _on_reset(self, event: h2.events.StreamReset, out: list[Event]) -> None:
        if event.remote_reset and not self._resets.take(self.clock()):
            self.on_limit("rapid_reset_burst")
            self._end(out, H2_ENHANCE_YOUR_CALM, "rapid reset budget exceeded")
            return
        stream = self._forget(event.stream_id)
        if stream is not None and stream.accepted:
            out.append(StreamAborted(event.stream_id, event.error_code or 0))
        self._drained(out)

    # ------------------------------------------------------------------ outbound
    def send_head(self, sid: int, status: int, headers) -> None:  # type: ignore[no-untyped-def]
        """Send response headers (no body yet)."""
        if self.ended or sid not in self._streams:
            return
        block = [(":status", str(status))] + [(k.lower(), str(v)) for k, v in headers]
        try:
            self._conn.send_headers(sid, block)
        except h2.exceptions.H2Error:
            self._forget(sid)
        self._pull()

    def send_data(self, sid: int, data: bytes, end: bool = False) -> None:
        """Queue body bytes; they leave as the peer's flow-control windows allow."""
        stream = self._streams.get(sid)
        if self.ended or stream is None or stream.local_ended:
            return
        self.last_activity = self.clock()
        if data:
            stream.out.append(bytes(data))
            stream.out_bytes += len(data)
        if end:
            stream.end_pending = True
        self._flush(stream)
        self._pull()

    def reset(self, sid: int, error_code: int) -> None:
        """RST_STREAM with ``error_code``; queued output for the stream is dropped."""
        stream = self._forget(sid)
        if self.ended or stream is None:
            return
        try:
            self._conn.reset_stream(sid, error_code)
        except h2.exceptions.H2Error:
            pass  # already closed on h2's side: nothing to reset
        self._pull()
        self._drained([])

    def backlog(self, sid: int) -> int:
        stream = self._streams.get(sid)
        return stream.out_bytes if stream is not None else 0

    def writable(self, sid: int) -> bool:
        """True when the stream's producer may queue more (below the low-water mark)."""
        return self.backlog(sid) <= self.limits.stream_buffer_low

    def is_open(self, sid: int) -> bool:
        return sid in self._streams

    @property
    def open_streams(self) -> int:
        """Streams that still owe work: refused ones whose answer has gone out do not count, so a
        peer that never ends a refused request cannot keep the connection from going idle."""
        return sum(1 for s in self._streams.values() if not (s.rejected and s.local_ended))

    def expire(self) -> list[Event]:
        """Apply the slow-peer timeouts now (the transport calls this on its timer).

        A header block open longer than ``header_timeout_s`` ends the connection (GOAWAY
        ENHANCE_YOUR_CALM). A stream whose request is not complete ``body_timeout_s`` after its
        HEADERS is answered 408 and reset if it was accepted (``StreamAborted`` tells the
        application to release it), and reset if it was refused.
        """
        out: list[Event] = []
        if self.ended:
            return out
        now = self.clock()
        if self._block_since is not None and now - self._block_since > self.limits.header_timeout_s:
            self.on_limit("header_timeout_s")
            return self._end(out, H2_ENHANCE_YOUR_CALM, "header block not completed in time")
        for stream in list(self._streams.values()):
            if stream.stalled_since is not None and now - stream.stalled_since > self.limits.write_timeout_s:
                # The peer's window stayed shut: a response it never lets out must not hold the
                # stream, and through it the connection, open (a peer may never send WINDOW_UPDATE).
                self.on_limit("write_timeout_s")
                sid = stream.head.stream_id
                try:
                    self._conn.reset_stream(sid, H2_CANCEL)
                except h2.exceptions.H2Error:
                    pass  # already closed on h2's side
                self._forget(sid)
                if stream.accepted:
                    out.append(StreamAborted(sid, H2_CANCEL))
                continue
            if now - stream.opened <= self.limits.body_timeout_s:
                continue
            if stream.accepted and not stream.remote_ended:
                self.on_limit("body_timeout_s")
                self._refuse_body(stream, Reject(408, [("content-type", "text/plain")],
                                                 b"request body not completed in time\n"), out)
            elif stream.rejected:
                sid = stream.head.stream_id
                try:
                    self._conn.reset_stream(sid, H2_NO_ERROR if stream.local_ended else H2_CANCEL)
                except h2.exceptions.H2Error:
                    pass  # already closed on h2's side
                self._forget(sid)
        self._pull()
        self._drained(out)
        return out

    def ping(self) -> None:
        if not self.ended:
            self._conn.ping(b"zerolayr")
            self._pull()

    def start_drain(self) -> None:
        """Finish the open streams, refuse new ones (REFUSED_STREAM), then GOAWAY(NO_ERROR) and end
        once none is open: at once when none is (module docstring: why the GOAWAY comes last)."""
        if self.ended or self.draining:
            return
        self.draining = True
        self._drain_last_stream = self._conn.highest_inbound_stream_id
        self._drained([])

    def close(self, error_code: int = H2_NO_ERROR, reason: str = "closed") -> ConnectionEnded:
        """Final GOAWAY; nothing else will be sent."""
        events: list[Event] = []
        self._end(events, error_code, reason)
        return ConnectionEnded(error_code, reason)

    def mark_flushed(self) -> None:
        """The transport wrote everything out: queued control answers have left."""
        self._queued_control = 0

    def connection_lost(self) -> None:
        """The socket is gone (RST, FIN, our close): end without sending anything and give back the
        budget of every body still buffered. Safe to call more than once, and after :meth:`close`."""
        self.ended = True
        for stream in self._streams.values():
            self._drop_body(stream)
        self._streams.clear()

    def data_to_send(self) -> bytes:
        self._pull()
        data = bytes(self._out)
        self._out.clear()
        return data

    # ------------------------------------------------------------------ internals
    def _flush(self, stream: _Stream) -> None:
        sid = stream.head.stream_id
        conn = self._conn
        try:
            while stream.out:
                window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if window <= 0:
                    if stream.stalled_since is None:
                        stream.stalled_since = self.clock()
                    return
                stream.stalled_since = None  # DATA leaves: progress
                chunk = stream.out.popleft()
                if len(chunk) > window:
                    stream.out.appendleft(chunk[window:])
                    chunk = chunk[:window]
                stream.out_bytes -= len(chunk)
                conn.send_data(sid, chunk)
                # A reader acknowledges our DATA with WINDOW_UPDATEs (stream + connection): those are
                # earned, so the flood budget only bites on updates that answer nothing we sent.
                self._window_updates.credit(2)
            if stream.end_pending and not stream.local_ended:
                conn.end_stream(sid)
                stream.local_ended = True
                if stream.rejected and not stream.remote_ended and (stream.stop_reading or self._large_body(stream)):
                    # RFC 9113 §8.1: a complete early response, then ask the client to stop sending. Only
                    # for large declared bodies: a small rest is cheaper to drop as it comes, and the stream
                    # stays open so h2 still validates what follows (e.g. malformed trailers).
                    conn.reset_stream(sid, H2_NO_ERROR)
                    stream.remote_ended = True
                self._maybe_forget(stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.FlowControlError, KeyError):
            self._forget(sid)

    EARLY_RESET_BODY = 65536

    @classmethod
    def _large_body(cls, stream: _Stream) -> bool:
        length = stream.head.headers.get("content-length", "")
        return length.isdigit() and int(length) > cls.EARLY_RESET_BODY

    def _flush_all(self) -> None:
        for stream in list(self._streams.values()):
            if stream.out or stream.end_pending:
                self._flush(stream)

    def _refuse_body(self, stream: _Stream, verdict: Reject, out: list[Event]) -> None:
        """Stop buffering an accepted stream's body: answer ``verdict``, then ask the peer to stop
        sending (RST_STREAM NO_ERROR once the answer is out); the application releases it."""
        stream.accepted = False
        stream.stop_reading = True
        self._drop_body(stream)
        self._reject(stream, verdict)
        out.append(StreamAborted(stream.head.stream_id, H2_NO_ERROR))

    def _drop_body(self, stream: _Stream) -> None:
        self.budget.give(stream.owner, len(stream.body))
        stream.body = bytearray()

    def _forget(self, sid: int) -> _Stream | None:
        stream = self._streams.pop(sid, None)
        if stream is not None:
            self._drop_body(stream)
        return stream

    def _maybe_forget(self, stream: _Stream) -> None:
        if stream.local_ended and stream.remote_ended:
            self._forget(stream.head.stream_id)
            self._drained([])

    def _drained(self, out: list[Event]) -> None:
        """Draining and no stream left, however the last one ended: GOAWAY(NO_ERROR) and end."""
        if self.draining and not self._streams and not self.ended:
            self._end(out, H2_NO_ERROR, "drained")

    def _end(self, out: list[Event], error_code: int, reason: str) -> list[Event]:
        if not self.ended:
            self.ended = True
            # After a ProtocolError h2 has already queued its own GOAWAY; don't send two.
            if self._conn.state_machine.state != h2.connection.ConnectionState.CLOSED:
                # Draining, streams refused since the drain began were never taken: the GOAWAY
                # names the last stream that was.
                last = self._drain_last_stream if self.draining else None
                self._conn.close_connection(error_code=error_code, last_stream_id=last)
            self._pull()
            for sid, stream in list(self._streams.items()):
                self._drop_body(stream)
                if stream.accepted:
                    out.append(StreamAborted(sid, error_code))
            self._streams.clear()
            out.append(ConnectionEnded(error_code, reason))
        return out

    def _pull(self) -> None:
        data = self._conn.data_to_send()
        if data:
            self._out += data
