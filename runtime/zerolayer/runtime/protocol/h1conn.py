"""Sans-IO HTTP/1.1 server connection on ``h11``, with the same surface as the HTTP/2 core.

Unmodified SDKs (``anthropic``, ``openai`` through httpx) speak HTTP/1.1 unless told
otherwise, so the same port answers both: the transport picks this core when the
first bytes are not the HTTP/2 preface (or ALPN chose ``http/1.1``). Requests on one
connection are sequential; each gets an odd "stream id" so the application can treat
both protocols alike. The gate runs when the request line and headers are parsed,
before any body byte is kept.

Slow peers (:meth:`H1ServerCore.expire`, on the transport's timer): a request head not
complete ``header_timeout_s`` after its first byte, or an accepted body not complete
``body_timeout_s`` after its head, is answered 408 and the connection closed. Buffered
body bytes are booked in the process's :class:`~zerolayer.runtime.limits.BodyBudget`.
"""

from __future__ import annotations

import http
import logging

import h11

from zerolayer.contract import H2_NO_ERROR
from zerolayer.runtime.protocol.core import ServerCore
from zerolayer.runtime.protocol.events import (
    Accept, ConnectionEnded, Event, Reject, RequestHead, RequestReady, StreamAborted)

log = logging.getLogger(__name__)
GATE_FAILED = Reject(500, [("content-type", "text/plain")], b"internal error\n")


def _reason(status: int) -> bytes:
    """A reason phrase: optional in HTTP/1.1, but some clients (h2load's parser) need one."""
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def _head_size(target: bytes, headers) -> int:  # type: ignore[no-untyped-def]
    """A head's size as HTTP/2 counts a header list (RFC 9113 §6.5.2: name + value + 32 each), so
    ``max_header_list_size`` means the same on both protocols."""
    return len(target) + sum(len(name) + len(value) + 32 for name, value in headers)


class H1ServerCore(ServerCore):
    http_version = "1.1"

    def _open(self, now: float) -> None:
        self._owner: str | None = None  # whose budget the body being buffered is booked to
        self._head_since: float | None = None  # first byte of a request whose head is incomplete
        self._opened = 0.0  # when the current request's head completed
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_list_size)
        self._next_id = 1
        self._sid: int | None = None  # the request being served
        self._head: RequestHead | None = None
        self._accepted = False
        self._context = None
        self._max_body = 0
        self._body = bytearray()
        self._responding = False
        self._response_done = False
        self._request_done = False

    # ------------------------------------------------------------------ inbound
    def receive(self, data: bytes) -> list[Event]:
        if self.ended:
            return []
        out: list[Event] = []
        self._feed(data)
        self._drain_events(out)
        self._track_head()
        return out

    def _feed(self, data: bytes) -> None:
        """Hand the peer's bytes to the parser (``b""``: its EOF)."""
        self._conn.receive_data(data)

    def _bytes_waiting(self) -> bool:
        """Bytes of a next request are buffered without a complete head having been handed out."""
        return bool(self._conn.trailing_data[0])

    def resume(self) -> list[Event]:
        """Process requests that arrived while the previous response was being sent."""
        out: list[Event] = []
        if not self.ended and self._sid is None:
            self._drain_events(out)
            self._track_head()
        return out

    def _track_head(self) -> None:
        """Start the header timeout when bytes of a next request wait without a complete head."""
        if self._sid is None and not self.ended and self._bytes_waiting():
            if self._head_since is None:
                self._head_since = self.clock()
        else:
            self._head_since = None

    def expire(self) -> list[Event]:
        """Apply the slow-peer timeouts now; returns the events they cause."""
        out: list[Event] = []
        if self.ended:
            return out
        now = self.clock()
        if self._head_since is not None and now - self._head_since > self.limits.header_timeout_s:
            self.on_limit("header_timeout_s")
            self._timeout_response(b"request head not completed in time\n")
            self._finish(out, "header timeout")
        elif (self._sid is not None and self._accepted and not self._request_done
              and now - self._opened > self.limits.body_timeout_s):
            self.on_limit("body_timeout_s")
            self._abort_accepted(out, 408, b"request body not completed in time\n")
            self._finish(out, "body timeout")
        return out

    def _timeout_response(self, body: bytes) -> None:
        """A 408 for a request whose head never completed (h11 cannot frame it as a response to one)."""
        if self._responding:
            return
        self._out += (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                      b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def _drain_events(self, out: list[Event]) -> None:
        while not self.ended:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                if "incomplete" in str(exc) or "too long" in str(exc).lower():
                    self.on_limit("max_header_list_size")
                self._protocol_error(exc, out)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_request(event, out)
            elif isinstance(event, h11.Data):
                self._on_data(event.data, out)
            elif isinstance(event, h11.EndOfMessage):
                if event.headers and _head_size(b"", event.headers) > self.limits.max_header_list_size:
                    self._trailers_too_large(out)
                    return
                self._request_done = True
                if self._accepted and self._head is not None:
                    out.append(RequestReady(self._head, bytes(self._body), self._context))
                    self._release_body()
                self._maybe_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                if self._sid is not None and self._accepted and not self._response_done:
                    out.append(StreamAborted(self._sid, H2_NO_ERROR))
                self._finish(out, "peer closed")
                return

    def _on_request(self, event: h11.Request, out: list[Event]) -> None:
        self.last_activity = self._opened = self.clock()
        self._head_since = None
        sid = self._next_id
        self._next_id += 2
        headers: dict[str, str] = {}
        for name_b, value_b in event.headers:
            name, value = name_b.decode("latin-1"), value_b.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        has_body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
        head = RequestHead(
            stream_id=sid,
            method=event.method.decode("ascii"),
            path=event.target.decode("latin-1"),
            headers=headers,
            authority=headers.get("host", ""),
            end_stream=not has_body,
            http_version="1.1",
        )
        self._sid, self._head = sid, head
        self._body = bytearray()
        self._responding = self._response_done = self._request_done = False
        if _head_size(event.target, event.headers) > self.limits.max_header_list_size:
            # h11 bounds only a head still incomplete; one that arrives whole in a single read is
            # measured here (issue 28, item 5).
            self.on_limit("max_header_list_size")
            verdict: Accept | Reject = Reject(431, [("content-type", "text/plain")],
                                              b"request header fields too large\n")
        elif len(event.headers) > self.limits.max_header_count:
            self.on_limit("max_header_count")
            verdict = Reject(431, [("content-type", "text/plain")], b"too many header fields\n")
        else:
            try:
                verdict = self.gate(head)
            except Exception:  # a bug in the gate answers this request, it does not crash the connection
                log.exception("gate failed on %s %s", head.method, head.path)
                verdict = GATE_FAILED
        if isinstance(verdict, Reject):
            self._accepted = False
            headers_out = list(verdict.headers)
            if has_body:
                # h11 cannot skip a body it has not read: answer, then close instead of reading it.
                headers_out.append(("connection", "close"))
            self._send_response(sid, verdict.status, headers_out, verdict.body)
            return
        self._accepted = True
        self._context = verdict.context
        self._max_body = verdict.max_body
        self._owner = verdict.owner

    def _on_data(self, data: bytes, out: list[Event]) -> None:
        if not self._accepted:
            self.discarded_body_bytes += len(data)
            return
        if len(self._body) + len(data) > self._max_body:
            self.on_limit("max_body_bytes")
            self._accepted = False
            self._release_body()
            self.discarded_body_bytes += len(data)
            out.append(StreamAborted(self._sid or 0, H2_NO_ERROR))
            self._send_response(
                self._sid or 0, 413, [("content-type", "text/plain"), ("connection", "close")],
                b"request body too large\n",
            )
            return
        refused = self.budget.take(self._owner, len(data))
        if refused is not None:
            self.on_limit(refused)
            self._accepted = False
            self._release_body()
            self.discarded_body_bytes += len(data)
            out.append(StreamAborted(self._sid or 0, H2_NO_ERROR))
            self._send_response(
                self._sid or 0, 503, [("content-type", "text/plain"), ("retry-after", "1"), ("connection", "close")],
                b"too many request bodies buffered; retry later\n",
            )
            return
        self._body += data

    def _trailers_too_large(self, out: list[Event]) -> None:
        """Trailers over ``max_header_list_size``: the request is refused (431) and the connection
        closed, whether or not its head was accepted."""
        self.on_limit("max_header_list_size")
        if self._accepted and self._sid is not None:
            self._abort_accepted(out, 431, b"request trailer fields too large\n")
        self._finish(out, "trailers too large")

    def _abort_accepted(self, out: list[Event], status: int, body: bytes) -> None:
        """The accepted request ends here: the application hears it aborted, its body's budget is given
        back, and the client gets ``status`` on a closing connection."""
        assert self._sid is not None
        out.append(StreamAborted(self._sid, H2_NO_ERROR))
        self._accepted = False
        self._release_body()
        self._send_response(self._sid, status, [("content-type", "text/plain"), ("connection", "close")], body)

    def _release_body(self) -> None:
        self.budget.give(self._owner, len(self._body))
        self._body = bytearray()

    # ------------------------------------------------------------------ outbound
    def _send_response(self, sid: int, status: int, headers, body: bytes) -> None:  # type: ignore[no-untyped-def]
        headers = list(headers) + [("content-length", str(len(body)))]
        self.send_head(sid, status, headers)
        self.send_data(sid, body, end=True)

    def send_head(self, sid: int, status: int, headers) -> None:  # type: ignore[no-untyped-def]
        if self.ended or sid != self._sid or self._responding:
            return
        self._responding = True
        pairs = [(k.lower(), str(v)) for k, v in headers]
        if self.draining and not any(k == "connection" for k, _ in pairs):
            pairs.append(("connection", "close"))
        try:
            self._out += self._conn.send(h11.Response(status_code=status, headers=pairs, reason=_reason(status)))
        except h11.LocalProtocolError:
            self._finish([], "local protocol error")

    def send_data(self, sid: int, data: bytes, end: bool = False) -> None:
        if self.ended or sid != self._sid or self._response_done:
            return
        self.last_activity = self.clock()
        try:
            if data:
                self._out += self._conn.send(h11.Data(data=data))
            if end:
                self._out += self._conn.send(h11.EndOfMessage())
                self._response_done = True
                self._maybe_next_cycle()
        except h11.LocalProtocolError:
            self._finish([], "local protocol error")

    def reset(self, sid: int, error_code: int) -> None:
        """HTTP/1.1 has no stream reset: closing the connection mid-body is the signal."""
        if sid == self._sid and not self._response_done:
            self._finish([], "stream reset")

    def backlog(self, sid: int) -> int:
        return 0  # bytes go straight to the transport, whose buffer applies backpressure

    def writable(self, sid: int) -> bool:
        return True

    def is_open(self, sid: int) -> bool:
        return not self.ended and sid == self._sid and not self._response_done

    @property
    def open_streams(self) -> int:
        return 1 if self._sid is not None and not self._response_done else 0

    def ping(self) -> None:
        """HTTP/1.1 has no PING; idle connections are closed by the idle timeout instead."""

    def start_drain(self) -> None:
        self.draining = True
        if self.open_streams == 0:
            self._finish([], "drained")

    def close(self, error_code: int = H2_NO_ERROR, reason: str = "closed") -> ConnectionEnded:
        self._finish([], reason)
        return ConnectionEnded(error_code, reason)

    def mark_flushed(self) -> None:
        pass

    def connection_lost(self) -> None:
        """The socket is gone (RST, or a close with no EOF seen): end without sending anything and
        give back the budget of the body being buffered. Safe to call more than once."""
        self._finish([], "connection lost")

    def data_to_send(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data

    # ------------------------------------------------------------------ internals
    def _maybe_next_cycle(self) -> None:
        if self._conn.our_state is h11.MUST_CLOSE or self._conn.their_state is h11.MUST_CLOSE:
            if self._response_done:
                self._finish([], "connection: close")
            return
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            if self.draining:
                self._finish([], "drained")
                return
            self._conn.start_next_cycle()
            self._sid = None

    def _protocol_error(self, exc: h11.RemoteProtocolError, out: list[Event]) -> None:
        if not self._responding and self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = getattr(exc, "error_status_hint", 400)
            try:
                body = b"bad request\n"
                self._out += self._conn.send(h11.Response(
                    status_code=status,
                    headers=[("content-type", "text/plain"), ("content-length", str(len(body))),
                             ("connection", "close")],
                    reason=_reason(status),
                ))
                self._out += self._conn.send(h11.Data(data=body))
                self._out += self._conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                pass
        self._finish(out, f"protocol error: {exc}")

    def _finish(self, out: list[Event], reason: str) -> None:
        if not self.ended:
            self.ended = True
            self._release_body()
            out.append(ConnectionEnded(H2_NO_ERROR, reason))
