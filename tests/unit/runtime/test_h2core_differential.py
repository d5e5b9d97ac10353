"""Differential test: the Python HTTP/2 core (python-hyper h2) and the native one (Rust h2) driven by the
same client script must produce the same events and the same answers.

Hypothesis writes a script of client and server steps: requests with and without bodies of several sizes
(the gate accepts, rejects or caps the body by path), client RST_STREAM, PING, SETTINGS and
WINDOW_UPDATE and GOAWAY, acknowledgements of received data (or none: a slow reader), the application's
``send_head``/``send_data``/``reset`` on requests that became ready, ``start_drain``, and a
deterministic clock advanced past the body and write timeouts with ``expire``. Each script runs once
against each core through a python-hyper h2 *client*; after every step the core's events (normalized,
order-insensitive within a step: the Python core reports in frame order, the native one by stream)
and what the client saw (responses, body bytes, END_STREAM, resets and codes, GOAWAY code and last
stream id, PING answers) are compared.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerolayer.runtime.limits import BodyBudget, Limits
from zerolayer.runtime.protocol.events import Accept, ConnectionEnded, Reject, RequestReady, StreamAborted
from zerolayer.runtime.protocol.h2conn import H2ServerCore

h2native = pytest.importorskip("zerolayer.runtime.protocol.h2native",
                               reason="the native core is not built: pip install ./native/h2core")
NativeH2ServerCore = h2native.NativeH2ServerCore

LIMITS = Limits(rapid_reset_burst=4, rapid_reset_per_second=1.0, max_body_bytes=3000,
                max_buffered_body_bytes=150_000, max_tenant_buffered_body_bytes=100_000)
PATHS = ["/ok", "/ok", "/reject", "/small", "/other-tenant"]
BODIES = [0, 0, 10, 1000, 5000, 70_000]


def gate(head):  # type: ignore[no-untyped-def]
    if head.path == "/reject":
        return Reject(403, [("content-type", "text/plain"), ("x-why", "path")], b"no\n")
    if head.path == "/small":
        return Accept(2000, ("ctx", head.path), owner="acme")
    if head.path == "/other-tenant":
        return Accept(1 << 20, ("ctx", head.path), owner="globex")
    return Accept(1 << 20, ("ctx", head.path), owner="acme")


ops = st.one_of(
    st.tuples(st.just("request"), st.sampled_from(PATHS), st.sampled_from(BODIES), st.booleans(), st.booleans()),
    st.tuples(st.just("more_body"), st.integers(0, 7), st.sampled_from([1, 100, 4000]), st.booleans()),
    st.tuples(st.just("client_reset"), st.integers(0, 7), st.sampled_from([0, 8])),
    st.tuples(st.just("ping")),
    st.tuples(st.just("goaway"), st.sampled_from([0, 2])),
    st.tuples(st.just("settings"), st.sampled_from([1000, 65535, 200_000])),
    st.tuples(st.just("window_update"), st.integers(-1, 7), st.sampled_from([1, 30_000, 2**31 - 1])),
    st.tuples(st.just("ack")),
    st.tuples(st.just("respond"), st.integers(0, 7), st.sampled_from([200, 404]),
              st.sampled_from([0, 10, 1000, 40_000]), st.booleans()),
    st.tuples(st.just("respond_more"), st.integers(0, 7), st.sampled_from([10, 20_000]), st.booleans()),
    st.tuples(st.just("server_reset"), st.integers(0, 7), st.sampled_from([0, 8])),
    st.tuples(st.just("server_ping")),
    st.tuples(st.just("drain")),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 31.0, 61.0])),
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def normalize_server(events) -> list:  # type: ignore[no-untyped-def]
    out = []
    for e in events:
        if isinstance(e, RequestReady):
            h = e.head
            out.append(("ready", h.stream_id, h.method, h.path, tuple(sorted(h.headers.items())), h.authority,
                        h.end_stream, e.body, e.context))
        elif isinstance(e, StreamAborted):
            out.append(("aborted", e.stream_id, e.error_code))
        elif isinstance(e, ConnectionEnded):
            out.append(("ended", e.error_code))
        else:
            out.append(("?", repr(e)))
    return sorted(out, key=repr)


class Run:
    """One core, one python-hyper client, and the transcript of what both saw."""

    def __init__(self, core_cls: type) -> None:
        self.clock = Clock()
        self.limit_hits: list[str] = []
        self.budget = BodyBudget.from_limits(LIMITS)
        self.core = core_cls(gate, LIMITS, on_limit=self.limit_hits.append, clock=self.clock, budget=self.budget)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.client = h2.connection.H2Connection(config)
        self.client.initiate_connection()
        self.streams: list[int] = []  # client streams in the order opened
        self.ready: set[int] = set()  # requests the application may answer
        self.head_sent: set[int] = set()
        self.declared: set[int] = set()  # streams whose request declared a content-length
        self.done: set[int] = set()
        self.unacked: dict[int, int] = {}
        self.bodies: dict[int, bytearray] = {}
        self.transcript: list = []
        self.step("open")

    def step(self, label) -> None:  # type: ignore[no-untyped-def]
        server = []
        data = self.client.data_to_send()
        if data:
            server = normalize_server(self.core.receive(data))
        self._server_events(server)
        client = self._deliver()
        self.transcript.append((label, server, client, self.core.ended, self.core.draining,
                                self.core.open_streams, self.budget.total))

    def _server_events(self, server: list) -> None:
        for e in server:
            if e[0] == "ready":
                self.ready.add(e[1])
            elif e[0] == "aborted":
                self.done.add(e[1])

    def _deliver(self) -> list:
        seen = []
        data = self.core.data_to_send()
        if not data:
            return seen
        try:
            events = self.client.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            return [("client protocol error", type(exc).__name__)]
        data_bytes: dict[int, int] = {}
        for e in events:
            if isinstance(e, h2.events.ResponseReceived):
                seen.append(("response", e.stream_id, tuple(e.headers)))
            elif isinstance(e, h2.events.DataReceived):
                data_bytes[e.stream_id] = data_bytes.get(e.stream_id, 0) + len(e.data)
                self.bodies.setdefault(e.stream_id, bytearray()).extend(e.data)
                self.unacked[e.stream_id] = self.unacked.get(e.stream_id, 0) + e.flow_controlled_length
            elif isinstance(e, h2.events.StreamEnded):
                seen.append(("end", e.stream_id))
            elif isinstance(e, h2.events.StreamReset):
                seen.append(("reset", e.stream_id, int(e.error_code)))
            elif isinstance(e, h2.events.ConnectionTerminated):
                seen.append(("goaway", int(e.error_code), e.last_stream_id))
            elif isinstance(e, h2.events.PingAckReceived):
                seen.append(("pong", e.ping_data))
            elif isinstance(e, h2.events.PingReceived):
                seen.append(("server ping",))  # the opaque bytes are each core's own
        seen += [("data", sid, n) for sid, n in data_bytes.items()]
        return sorted(seen, key=repr)

    def _sid(self, index: int, pool) -> int | None:  # type: ignore[no-untyped-def]
        candidates = [s for s in self.streams if s in pool] if pool is not None else self.streams
        return candidates[index % len(candidates)] if candidates else None

    def _send_body(self, sid: int, n: int, end: bool) -> None:
        chunk = 16384
        if n == 0:
            self.client.send_data(sid, b"", end_stream=end)
        for at in range(0, n, chunk):
            self.client.send_data(sid, bytes([97 + at // chunk % 26]) * min(chunk, n - at),
                                  end_stream=end and at + chunk >= n)

    def op(self, op: tuple) -> None:
        kind = op[0]
        if self.core.ended and kind not in ("advance",):
            return
        try:
            self._client_op(op)
        except (h2.exceptions.H2Error, KeyError) as exc:
            # What the client queued before refusing (earlier body chunks, its SETTINGS ACK) still goes.
            self.transcript.append(("client refused", op, type(exc).__name__))
        self._server_op(op)
        self.step(op)

    def _client_op(self, op: tuple) -> None:
        kind = op[0]
        client = self.client
        if kind == "request":
            _, path, size, declare_length, end_after = op
            sid = client.get_next_available_stream_id()
            headers = [(":method", "POST" if size else "GET"), (":path", path), (":scheme", "http"),
                       (":authority", "node"), ("x-api-key", "k")]
            if declare_length and size:
                headers.append(("content-length", str(size)))
                self.declared.add(sid)
            self.streams.append(sid)
            client.send_headers(sid, headers, end_stream=size == 0 and end_after)
            if size:
                self._send_body(sid, size, end_after)
        elif kind == "more_body":
            # Not on a stream that declared its content-length: a body longer than declared is malformed,
            # a connection error for python-hyper h2 and a stream error (RST_STREAM) for Rust h2, as RFC
            # 9113 §8.1.1 has it: a documented difference (docs/server-core.md), not compared here.
            sid = self._sid(op[1], set(self.streams) - self.declared)
            if sid is not None:
                self._send_body(sid, op[2], op[3])
        elif kind == "client_reset":
            sid = self._sid(op[1], None)
            if sid is not None:
                client.reset_stream(sid, op[2])
        elif kind == "ping":
            client.ping(b"12345678")
        elif kind == "goaway":
            client.close_connection(error_code=op[1])
        elif kind == "settings":
            client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: op[1]})
        elif kind == "window_update":
            sid = 0 if op[1] < 0 else self._sid(op[1], None)
            if sid is not None:
                client.increment_flow_control_window(op[2], stream_id=sid or None)
        elif kind == "ack":
            for sid, n in sorted(self.unacked.items()):
                if n:
                    client.acknowledge_received_data(n, sid)
            self.unacked.clear()

    def _server_op(self, op: tuple) -> None:
        kind = op[0]
        core = self.core
        live = self.ready - self.done
        if kind == "respond":
            sid = self._sid(op[1], live - self.head_sent)
            if sid is not None:
                self.head_sent.add(sid)
                core.send_head(sid, op[2], [("content-type", "text/plain"), ("X-Mixed", 7)])
                core.send_data(sid, b"r" * op[3], end=op[4])
                if op[4]:
                    self.done.add(sid)
        elif kind == "respond_more":
            sid = self._sid(op[1], live & self.head_sent)
            if sid is not None:
                core.send_data(sid, b"m" * op[2], end=op[3])
                if op[3]:
                    self.done.add(sid)
        elif kind == "server_reset":
            sid = self._sid(op[1], live)
            if sid is not None:
                core.reset(sid, op[2])
                self.done.add(sid)
        elif kind == "server_ping":
            core.ping()
        elif kind == "drain":
            core.start_drain()
        elif kind == "advance":
            self.clock.now += op[1]
            self.transcript.append(("expire", normalize_server(core.expire())))

    def close(self) -> None:
        if not self.core.ended:
            self.transcript.append(("close", self.core.close().error_code))
            self.step("closed")
        self.core.connection_lost()
        self.transcript.append(("final", {sid: bytes(b) for sid, b in sorted(self.bodies.items())},
                                self.budget.total, sorted(self.limit_hits)))


def run(core_cls: type, script: list) -> Run:
    r = Run(core_cls)
    for op in script:
        r.op(op)
    r.close()
    return r


def compare(script: list) -> None:
    py = run(H2ServerCore, script)
    native = run(NativeH2ServerCore, script)
    for i, (a, b) in enumerate(zip(py.transcript, native.transcript)):
        assert a == b, f"step {i} differs:\n  python: {a}\n  native: {b}\n  script: {script}"
    assert len(py.transcript) == len(native.transcript)
    assert py.budget.total == 0 and native.budget.total == 0


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=st.lists(ops, min_size=1, max_size=25))
def test_both_cores_agree_on_every_script(script):
    compare(script)


@pytest.mark.parametrize("script", [
    # A request, its answer, a drain: GOAWAY(NO_ERROR) names stream 1.
    [("request", "/ok", 10, True, True), ("respond", 0, 200, 10, True), ("drain",)],
    # Refusals while draining, then the last stream ends.
    [("request", "/ok", 0, False, True), ("drain",), ("request", "/ok", 0, False, True), ("respond", 0, 200, 5, True)],
    # A large declared body rejected at the gate: early answer, RST_STREAM(NO_ERROR).
    [("request", "/reject", 70_000, True, True)],
    # Body over the gate's cap: 413 and StreamAborted(NO_ERROR).
    [("request", "/small", 5000, False, True)],
    # A slow reader: the response stalls on flow control until the write timeout resets it.
    [("request", "/ok", 0, False, True), ("respond", 0, 200, 40_000, False), ("respond_more", 0, 20_000, False),
     ("respond_more", 0, 20_000, True), ("advance", 61.0)],
    # A body that never completes: 408 at the body timeout.
    [("request", "/ok", 1000, False, False), ("advance", 61.0)],
    # Rapid resets past the budget: GOAWAY(ENHANCE_YOUR_CALM).
    [("request", "/ok", 1000, False, False), ("client_reset", -1, 8)] * 6,
    # The client's GOAWAY ends the connection; the accepted stream still buffering is aborted.
    [("request", "/ok", 1000, False, False), ("ping",), ("goaway", 0)],
    # Bodies of two tenants past their share of the budget: 503.
    [("request", "/ok", 70_000, False, False), ("request", "/ok", 70_000, False, False)],
])
def test_both_cores_agree_on_known_scripts(script):
    compare(script)
