"""The compiled HTTP/1.1 server core: :class:`NativeH1ServerCore`, the interface and behaviour of
:class:`~zerolayer.runtime.protocol.h1conn.H1ServerCore` with the parsing done by ``httptools`` (the C
``llhttp`` parser uvicorn uses) and responses written by plain byte formatting instead of ``h11``'s
event machinery. Selected, with the native HTTP/2 core, by ``server.core: native``. A subclass of
``H1ServerCore``: what follows a parsed request (gate bookkeeping, body buffering and budget, limits,
timeouts, drain, teardown) is its code.

How it keeps ``h11``'s one-request-at-a-time semantics: llhttp parses every byte it is given, pipelined
requests included, and cannot be paused between messages, so its callbacks only *record* what they see
(a head, body pieces, the end with its trailers, a parse error, the peer's EOF) in a queue. The queue
is replayed exactly where ``h11`` would hand out the same event: the gate of a pipelined request runs
when the previous response is done (:meth:`resume`), a parse error in a pipelined request is answered
only then, and so on. Responses are framed as ``h11`` frames them (content-length, chunked, or
close-delimited for an HTTP/1.0 peer; ``Connection: close`` added when keep-alive is off; a response
with a wrong length ends the connection).

Where it differs from the Python core, and why, is in ``docs/server-core.md`` ("The HTTP/1.1 half");
in short: llhttp refuses some heads h11 serves (obs-fold, ``content-length`` with
``transfer-encoding``, repeated or listed ``content-length``, HTTP versions other than 1.0/1.1, bare LF
line ends, unknown methods), answered 400 and closed as h1conn answers what h11 refuses; it ignores
blank lines before a request-line (h11: 400); it refuses garbage at the first bad byte, h11 once the
line is complete; a head still incomplete is bounded per read, not per byte (the 431 may trip one read
after h11's, never before), and an incomplete trailer section only once it completes.
"""

from __future__ import annotations

import logging

import httptools

from zerolayer.contract import H2_NO_ERROR
from zerolayer.runtime.protocol.events import (
    Accept, Event, Reject, RequestHead, RequestReady, StreamAborted)
from zerolayer.runtime.protocol.h1conn import GATE_FAILED, H1ServerCore, _head_size, _reason

__all__ = ["NativeH1ServerCore"]
log = logging.getLogger(__name__)

# Queue records: (kind, ...)
_HEAD, _BODY, _END, _ERROR, _EOF = range(5)
_NO_BODY_STATUS = frozenset({204, 304})
_STATUS_LINE: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINE.get(status)
    if line is None:
        line = _STATUS_LINE[status] = b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))
    return line


class _Recorder:
    """The llhttp side: ``httptools``' callbacks record what they see in ``queue``, which the core
    replays where h11 would hand out the same event (see the module docstring)."""

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        self.queue: list[tuple] = []  # type: ignore[type-arg]
        self.parser = httptools.HttpRequestParser(self)
        self.dead = False  # llhttp stopped on an error (recorded); later bytes are ignored
        self.eof = False
        self.in_message = False  # llhttp is inside a message (begun, not complete)
        self.in_head = False  # ... and its head is not complete
        self.head_raw = 0  # bytes read while the current head was incomplete (a lower bound)
        self.feeding = 0
        self.url = b""
        self.headers: dict[str, str] = {}
        self.count = self.size = self.hosts = 0
        self.te: bytes | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.merge = False  # the next body piece may join the last queued one

    def on_message_begin(self) -> None:
        self.in_message = self.in_head = True
        self.merge = False
        # Where in this read the head began is not known: the read it began in counts as nothing, so
        # the bound trips at most one read after h11's (never before it).
        self.head_raw = -self.feeding
        self.url = b""
        self.headers = {}
        self.count = self.size = self.hosts = 0
        self.te = None
        self.trailers = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace; h11 drops it
        if self.in_head:
            # The head's dict (lower-case names, repeats joined with ", "), its size as h1conn measures
            # it (name + value + 32 each) and count, built as llhttp reports each field.
            self.count += 1
            self.size += len(name) + len(value) + 32
            key = name.lower().decode("latin-1")
            headers = self.headers
            if key in headers:
                headers[key] = f"{headers[key]}, {value.decode('latin-1')}"
            else:
                headers[key] = value.decode("latin-1")
            if key == "host":
                self.hosts += 1
            elif key == "transfer-encoding":
                self.te = value
        else:
            if self.trailers is None:
                self.trailers = []
            self.trailers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self.parser
        self.queue.append((_HEAD, parser.get_method(), self.url, self.headers, parser.get_http_version(),
                           self.count, len(self.url) + self.size, self.hosts))

    def on_body(self, body: bytes) -> None:
        queue = self.queue
        # The queue's last record is never one already replayed (the core clears a replayed queue).
        if self.merge and queue and queue[-1][0] == _BODY:
            # h11 hands out what it has buffered of one chunk (or of a content-length body) at once
            queue[-1] = (_BODY, queue[-1][1] + body)
        else:
            queue.append((_BODY, body))
            self.merge = True

    def on_chunk_header(self) -> None:
        self.merge = False

    def on_message_complete(self) -> None:
        self.in_message = False
        self.queue.append((_END, self.trailers))

    def feed(self, data: bytes) -> None:
        if self.dead or self.eof:
            return
        self.feeding = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # An Upgrade/CONNECT request: llhttp stops after it. h11 answers it like any request
            # (no 101 is ever sent), so parsing goes on with a fresh parser after it.
            rest = data[exc.args[0]:]
            self.parser = httptools.HttpRequestParser(self)
            if rest:
                self.feed(rest)
            return
        except httptools.HttpParserError as exc:
            self.dead = True
            # h11's status hint: 501 for a transfer coding other than chunked, else 400
            status = 501 if self.in_head and self.te is not None and self.te.lower() != b"chunked" else 400
            self.queue.append((_ERROR, status, str(exc)))
            return
        if self.in_head:
            self.head_raw += len(data)
            if self.head_raw > self.max_head:
                self.dead = True
                self.queue.append((_ERROR, 431, "Receive buffer too long"))

    def end(self) -> None:
        """The peer's EOF: an error inside a message (h11: peer unexpectedly closed), else an EOF."""
        if not self.eof and not self.dead:
            self.queue.append((_ERROR, 400, "peer unexpectedly closed connection") if self.in_message else (_EOF,))
        self.eof = True


class NativeH1ServerCore(H1ServerCore):
    """One server-side HTTP/1.1 connection, sans I/O, parsed by llhttp (``httptools``).

    A subclass of :class:`H1ServerCore`: the body, limit, timeout, drain and teardown paths are
    inherited unchanged; parsing (``receive``/``resume``), the request head and the response framing
    are replaced.
    """

    http_version = "1.1"

    def _open(self, now: float) -> None:
        self._owner: str | None = None
        self._head_since: float | None = None
        self._opened = 0.0
        self._next_id = 1
        self._sid: int | None = None
        self._head: RequestHead | None = None
        self._accepted = False
        self._context = None
        self._max_body = 0
        self._body = bytearray()
        self._responding = False
        self._response_done = False
        self._request_done = False
        self._keep_alive = True  # h11's ConnectionState.keep_alive: once off, never on again
        self._method = b""  # of the request being answered (framing: HEAD has no body)
        self._peer_10 = False  # the request being answered is HTTP/1.0
        self._chunked = False  # response framing
        self._left: int | None = None  # response content-length bytes still to send
        self._rec = _Recorder(self.limits.max_header_list_size)
        self._queue = self._rec.queue
        self._at = 0  # the next record to replay

    # ------------------------------------------------------------------ inbound
    def _feed(self, data: bytes) -> None:
        if data:
            self._rec.feed(data)
        else:
            self._rec.end()

    def _bytes_waiting(self) -> bool:
        return self._rec.in_message or self._at < len(self._queue)

    def _drain_events(self, out: list[Event]) -> None:
        queue = self._queue
        while self._at < len(queue) and not self.ended:
            record = queue[self._at]
            kind = record[0]
            if self._request_done and self._sid is not None and kind != _EOF:
                if self._keep_alive:
                    break  # h11 PAUSED: the next request waits for this response
                # h11 MUST_CLOSE: any byte after the last request is an error, answered at once
                kind = _ERROR
                record = (_ERROR, 400, "Got data when expecting EOF")
            self._at += 1
            if kind == _BODY:
                self._on_data(record[1], out)
            elif kind == _HEAD:
                self._on_head(record, out)
            elif kind == _END:
                trailers = record[1]
                if trailers and _head_size(b"", trailers) > self.limits.max_header_list_size:
                    self._trailers_too_large(out)
                    break
                self._request_done = True
                if self._accepted and self._head is not None:
                    out.append(RequestReady(self._head, bytes(self._body), self._context))
                    self._release_body()
                self._maybe_next_cycle()
            elif kind == _ERROR:
                if record[1] == 431:
                    self.on_limit("max_header_list_size")
                self._bad_request(record[1], record[2], out)
            else:  # _EOF
                if self._sid is not None and self._accepted and not self._response_done:
                    out.append(StreamAborted(self._sid, H2_NO_ERROR))
                self._finish(out, "peer closed")
        if self._at == len(queue):
            queue.clear()
            self._at = 0

    def _on_head(self, record: tuple, out: list[Event]) -> None:  # type: ignore[type-arg]
        _, method_b, target, headers, version, count, size, hosts = record
        # What h11 refuses in a head that llhttp lets through.
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            self._bad_request(400, "missing or repeated Host header", out)
            return
        te = headers.get("transfer-encoding")
        if te is not None and te.lower() != "chunked":
            self._bad_request(501, "Only Transfer-Encoding: chunked is supported", out)
            return
        if te is not None:
            headers["transfer-encoding"] = te.lower()
        self.last_activity = self._opened = self.clock()
        self._head_since = None
        sid = self._next_id
        self._next_id += 2
        has_body = headers.get("content-length", "0") not in ("", "0") or te is not None
        head = RequestHead(sid, method_b.decode("ascii"), target.decode("latin-1"), headers,
                           headers.get("host", ""), not has_body, "1.1")
        self._sid, self._head = sid, head
        self._method = method_b
        self._peer_10 = version != "1.1"
        connection = headers.get("connection")
        if self._peer_10 or (connection is not None
                             and "close" in [t.strip() for t in connection.lower().split(",")]):
            self._keep_alive = False
        self._body = bytearray()
        self._responding = self._response_done = self._request_done = False
        if size > self.limits.max_header_list_size:
            self.on_limit("max_header_list_size")
            verdict: Accept | Reject = Reject(431, [("content-type", "text/plain")],
                                              b"request header fields too large\n")
        elif count > self.limits.max_header_count:
            self.on_limit("max_header_count")
            verdict = Reject(431, [("content-type", "text/plain")], b"too many header fields\n")
        else:
            try:
                verdict = self.gate(head)
            except Exception:
                log.exception("gate failed on %s %s", head.method, head.path)
                verdict = GATE_FAILED
        if isinstance(verdict, Reject):
            self._accepted = False
            headers_out = list(verdict.headers)
            if has_body:
                headers_out.append(("connection", "close"))
            self._send_response(sid, verdict.status, headers_out, verdict.body)
            return
        self._accepted = True
        self._context = verdict.context
        self._max_body = verdict.max_body
        self._owner = verdict.owner

    # ------------------------------------------------------------------ outbound
    def _head_bytes(self, status: int, pairs: list[tuple[str, str]]) -> bytes | None:
        """The response head as h11 writes it (its framing and keep-alive clean-up), or None where
        h11 would refuse it (LocalProtocolError)."""
        # The fields' lines, written once: kept as they are unless the framing below changes the fields.
        # A CR or LF inside a name or value shows as more line ends than fields.
        lines = "".join([f"{name}: {value}\r\n" for name, value in pairs])
        if lines.count("\n") != len(pairs) or lines.count("\r") != len(pairs):
            return None
        text: str | None = lines
        length: str | None = None
        close = te = False
        for name, value in pairs:
            if ":" in name:
                return None
            if name == "content-length":
                length = value.strip()
            elif name == "connection" and "close" in value.lower():
                close = True
            elif name == "transfer-encoding":
                te = True
        head_request = self._method == b"HEAD"
        self._chunked = False
        if status in _NO_BODY_STATUS or (self._method == b"CONNECT" and 200 <= status < 300):
            self._left = 0
        elif length is not None and not te:
            if not length.isdigit():
                return None
            self._left = int(length)
        else:  # a body of unknown length: chunked to an HTTP/1.1 peer, close-delimited to 1.0
            self._left = None
            pairs = [(n, v) for n, v in pairs if n != "content-length" and n != "transfer-encoding"]
            text = None
            if self._peer_10:
                if not head_request:
                    return self._write_head(status, pairs, force_close=True, close=close)
            else:
                self._chunked = True
                pairs.append(("Transfer-Encoding", "chunked"))
        if head_request:  # h11 picks a HEAD response's headers as for GET, and sends no body
            self._chunked = False
            self._left = 0
        return self._write_head(status, pairs, force_close=False, close=close, text=text)

    def _write_head(self, status: int, pairs: list[tuple[str, str]], *, force_close: bool, close: bool,
                    text: str | None = None) -> bytes:
        """``text``: ``pairs``' lines already written (:meth:`_head_bytes`), unless they change here."""
        if not self._keep_alive or force_close:
            tokens: set[str] = set()
            kept = []
            for name, value in pairs:
                if name == "connection":
                    tokens.update(t.strip().lower() for t in value.split(",") if t.strip())  # h11: case-blind
                else:
                    kept.append((name, value))
            tokens.discard("keep-alive")
            tokens.add("close")
            pairs = kept + [("Connection", t) for t in sorted(tokens)]
            text = None
        if close or force_close:
            self._keep_alive = False
        if text is None:
            text = "".join([f"{name}: {value}\r\n" for name, value in pairs])
        return _status_line(status) + text.encode("latin-1") + b"\r\n"

    def send_head(self, sid: int, status: int, headers) -> None:  # type: ignore[no-untyped-def]
        if self.ended or sid != self._sid or self._responding:
            return
        self._responding = True
        pairs = [(k.lower(), str(v)) for k, v in headers]
        if self.draining and not any(k == "connection" for k, _ in pairs):
            pairs.append(("connection", "close"))
        try:
            head = self._head_bytes(status, pairs)
        except UnicodeEncodeError:
            head = None
        if head is None:
            self._finish([], "local protocol error")
            return
        self._out += head

    def send_data(self, sid: int, data: bytes, end: bool = False) -> None:
        if self.ended or sid != self._sid or self._response_done:
            return
        self.last_activity = self.clock()
        if not self._responding:
            self._finish([], "local protocol error")
            return
        if data:
            if self._chunked:
                self._out += b"%x\r\n" % len(data)
                self._out += data
                self._out += b"\r\n"
            elif self._left is None:
                self._out += data
            elif len(data) > self._left:
                self._finish([], "local protocol error")
                return
            else:
                self._left -= len(data)
                self._out += data
        if end:
            if self._chunked:
                self._out += b"0\r\n\r\n"
            elif self._left:
                self._finish([], "local protocol error")
                return
            self._response_done = True
            self._maybe_next_cycle()

    def _maybe_next_cycle(self) -> None:
        if not self._keep_alive:
            # h11 MUST_CLOSE: once either side is done with keep-alive off, the connection ends with
            # the response.
            if self._response_done:
                self._finish([], "connection: close")
            return
        if self._response_done and self._request_done:
            if self.draining:
                self._finish([], "drained")
                return
            self._sid = None

    def _bad_request(self, status: int, message: str, out: list[Event]) -> None:
        if not self._responding:
            body = b"bad request\n"
            head = self._write_head(status, [("content-type", "text/plain"), ("content-length", str(len(body))),
                                             ("connection", "close")], force_close=False, close=True)
            self._out += head + body
        self._finish(out, f"protocol error: {message}")
