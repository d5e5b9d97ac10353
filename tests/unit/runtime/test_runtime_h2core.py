"""The sans-IO HTTP/2 core, driven by real frames from an h2 client and hyperframe. No sockets."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    WindowUpdateFrame,
)

from zerolayer.contract import H2_ENHANCE_YOUR_CALM, H2_NO_ERROR, H2_REFUSED_STREAM
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol.events import Accept, ConnectionEnded, Reject, RequestReady, StreamAborted
from zerolayer.runtime.protocol.h2conn import H2ServerCore
from zerolayer.runtime.protocol.h2native import NativeH2ServerCore

CORES = {"python": H2ServerCore, "native": NativeH2ServerCore}


@pytest.fixture(params=sorted(CORES), autouse=True)
def core_cls(request):  # type: ignore[no-untyped-def]
    """Every test runs against both cores: the Pair helper and direct constructions pick it up."""
    global CORE
    CORE = CORES[request.param]
    yield CORE
    CORE = H2ServerCore


CORE = H2ServerCore

REQUEST = [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"), (":authority", "node")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Pair:
    """An h2 client talking to the core through in-memory byte hand-offs."""

    def __init__(self, verdict=None, limits: Limits | None = None) -> None:  # type: ignore[no-untyped-def]
        self.heads = []
        self.body_seen_at_gate: list[int] = []
        self.limit_hits: list[str] = []
        self.clock = Clock()
        self.verdict = verdict or (lambda head: Accept(1 << 20, "ctx"))

        def gate(head):  # type: ignore[no-untyped-def]
            self.heads.append(head)
            self.body_seen_at_gate.append(self.core.discarded_body_bytes)
            return self.verdict(head)

        self.core = CORE(gate, limits or Limits(), on_limit=self.limit_hits.append, clock=self.clock)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.client.initiate_connection()
        self.client_events: list[h2.events.Event] = []
        self.events = self.send()  # preface + SETTINGS both ways
        self.back()

    def send(self, raw: bytes = b"") -> list:  # type: ignore[type-arg]
        data = self.client.data_to_send() + raw
        return self.core.receive(data) if data else []

    def back(self) -> list[h2.events.Event]:
        events = self.client.receive_data(self.core.data_to_send())
        self.client_events += events
        return events


def test_accepted_request_is_ready_with_its_body_once_the_stream_ends():
    p = Pair()
    p.client.send_headers(1, REQUEST + [("x-api-key", "k")])
    p.client.send_data(1, b'{"a":', end_stream=False)
    assert p.send() == []  # HEADERS and part of the body: nothing to serve yet
    p.client.send_data(1, b"1}", end_stream=True)
    (ready,) = p.send()
    assert isinstance(ready, RequestReady)
    assert ready.body == b'{"a":1}' and ready.context == "ctx"
    assert ready.head.method == "POST" and ready.head.path == "/v1/messages"
    assert ready.head.headers["x-api-key"] == "k"


def test_rejected_stream_body_is_never_buffered():
    p = Pair(verdict=lambda head: Reject(401, [("x-zerolayer-error", "AUTHENTICATION")], b"{}"))
    body = b"x" * 60000
    p.client.send_headers(1, REQUEST)
    p.client.send_data(1, body[:16000])
    events = p.send()  # HEADERS and the first DATA arrive in one read
    for i in range(16000, 60000, 16000):
        p.client.send_data(1, body[i:i + 16000], end_stream=i + 16000 >= 60000)
        events += p.send()
    assert not any(isinstance(e, RequestReady) for e in events)
    # The gate decided with zero body bytes seen; the body was acknowledged and dropped.
    assert p.body_seen_at_gate == [0]
    # Every byte of the body was credited back for flow control and dropped as it came.
    assert p.core.discarded_body_bytes == len(body)
    assert not p.core.is_open(1)
    got = p.back()
    response = next(e for e in got if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)[b":status"] == b"401"
    assert dict(response.headers)[b"x-zerolayer-error"] == b"AUTHENTICATION"


def test_a_complete_early_answer_asks_a_large_body_to_stop():
    p = Pair(verdict=lambda head: Reject(403, [], b"no"))
    p.client.send_headers(1, REQUEST + [("content-length", "1000000")])  # a big body still to come
    p.send()
    got = p.back()
    assert any(isinstance(e, h2.events.StreamEnded) for e in got)
    reset = next(e for e in got if isinstance(e, h2.events.StreamReset))
    assert reset.error_code == H2_NO_ERROR  # RFC 9113 §8.1


def test_a_small_rest_of_a_rejected_body_is_dropped_as_it_comes():
    p = Pair(verdict=lambda head: Reject(403, [], b"no"), limits=Limits(max_body_bytes=1000))
    p.client.send_headers(1, REQUEST)
    p.send()
    got = p.back()
    assert not any(isinstance(e, h2.events.StreamReset) for e in got)  # the stream stays open...
    p.client.send_data(1, b"a" * 600)
    p.send()
    assert p.core.discarded_body_bytes == 600 and p.core.is_open(1)  # ...dropping the body
    p.client.send_data(1, b"a" * 600)
    p.send()
    assert not p.core.is_open(1)  # past max_body_bytes: told to stop
    reset = next(e for e in p.back() if isinstance(e, h2.events.StreamReset))
    assert reset.error_code == H2_NO_ERROR


def test_body_over_the_limit_is_refused_and_dropped():
    p = Pair(verdict=lambda head: Accept(100, None))
    p.client.send_headers(1, REQUEST)
    p.client.send_data(1, b"y" * 101, end_stream=True)
    events = p.send()
    assert any(isinstance(e, StreamAborted) for e in events)
    assert not any(isinstance(e, RequestReady) for e in events)
    assert "max_body_bytes" in p.limit_hits
    response = next(e for e in p.back() if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)[b":status"] == b"413"


def test_too_many_header_fields_get_431_without_calling_the_gate():
    p = Pair(limits=Limits(max_header_count=5))
    p.client.send_headers(1, REQUEST + [(f"x-h{i}", "v") for i in range(6)], end_stream=True)
    assert p.send() == []
    assert p.heads == [] and p.limit_hits == ["max_header_count"]
    response = next(e for e in p.back() if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)[b":status"] == b"431"


def test_oversized_header_list_ends_the_connection():
    p = Pair(limits=Limits(max_header_list_size=1024))
    p.client.send_headers(1, REQUEST + [("x-big", "v" * 2000)], end_stream=True)
    events = p.send()
    assert any(isinstance(e, ConnectionEnded) for e in events)
    assert p.limit_hits == ["max_header_list_size"]
    assert p.core.ended


def raw_frames(data: bytes) -> list[Frame]:
    out = []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        out.append(frame)
        data = data[9 + length:]
    return out


def _goaway(p: Pair) -> h2.events.ConnectionTerminated:
    return next(e for e in p.back() if isinstance(e, h2.events.ConnectionTerminated))


def test_rapid_reset_budget_sends_goaway_enhance_your_calm():
    p = Pair(limits=Limits(rapid_reset_burst=10, rapid_reset_per_second=1))
    events = []
    for i in range(12):
        sid = 1 + 2 * i
        p.client.send_headers(sid, REQUEST)
        p.client.reset_stream(sid)
        events += p.send()
    assert not any(isinstance(e, RequestReady) for e in events)  # no reset stream ever became work
    assert p.limit_hits == ["rapid_reset_burst"]
    assert p.core.ended
    assert _goaway(p).error_code == H2_ENHANCE_YOUR_CALM


def test_resets_within_budget_refill_over_time():
    p = Pair(limits=Limits(rapid_reset_burst=5, rapid_reset_per_second=10))
    for i in range(20):
        sid = 1 + 2 * i
        p.client.send_headers(sid, REQUEST)
        p.client.reset_stream(sid)
        p.send()
        p.clock.now += 0.5  # 5 tokens back every step: never over budget
    assert p.limit_hits == [] and not p.core.ended


def test_reset_of_an_accepted_stream_reports_stream_aborted():
    p = Pair()
    p.client.send_headers(1, REQUEST)
    p.send()
    p.client.reset_stream(1, error_code=8)
    (aborted,) = p.send()
    assert aborted == StreamAborted(1, 8)


def test_continuation_flood_is_limited_by_frame_count():
    p = Pair(limits=Limits(max_continuation_frames=8))
    block = hpack.Encoder().encode(REQUEST + [("x-pad", "p" * 64)])
    frames = [HeadersFrame(1, data=block[:1])]
    frames += [ContinuationFrame(1, data=block[i:i + 1]) for i in range(1, 20)]
    events = p.send(b"".join(f.serialize() for f in frames))
    assert any(isinstance(e, ConnectionEnded) for e in events)
    assert p.limit_hits == ["max_continuation_frames"]
    assert _goaway(p).error_code == H2_ENHANCE_YOUR_CALM


def test_headers_split_over_a_few_continuations_are_fine():
    p = Pair(limits=Limits(max_continuation_frames=8))
    block = hpack.Encoder().encode(REQUEST)
    third = len(block) // 3
    frames = [HeadersFrame(1, data=block[:third], flags=["END_STREAM"]),
              ContinuationFrame(1, data=block[third:2 * third]),
              ContinuationFrame(1, data=block[2 * third:], flags=["END_HEADERS"])]
    events = p.send(b"".join(f.serialize() for f in frames))
    assert [type(e) for e in events] == [RequestReady], events


def test_unread_ping_answers_are_bounded():
    p = Pair(limits=Limits(max_queued_control_frames=50))
    flood = b"".join(PingFrame(0, opaque_data=b"12345678").serialize() for _ in range(51))
    p.send(flood)
    assert p.limit_hits == ["max_queued_control_frames"] and p.core.ended


def test_pings_are_fine_when_the_peer_reads_its_answers():
    p = Pair(limits=Limits(max_queued_control_frames=50))
    for _ in range(10):
        p.send(b"".join(PingFrame(0, opaque_data=b"12345678").serialize() for _ in range(40)))
        p.back()
        p.core.mark_flushed()  # the transport reports the answers left the socket
    assert p.limit_hits == [] and not p.core.ended


def test_empty_data_frame_flood():
    p = Pair(limits=Limits(empty_frames_burst=20, empty_frames_per_second=1))
    p.client.send_headers(1, REQUEST)
    p.send()
    p.send(b"".join(DataFrame(1, data=b"").serialize() for _ in range(25)))
    assert p.limit_hits == ["empty_frames_burst"] and p.core.ended


def test_window_update_flood():
    p = Pair(limits=Limits(window_update_burst=30, window_update_per_second=1))
    p.send(b"".join(WindowUpdateFrame(0, window_increment=1).serialize() for _ in range(31)))
    assert p.limit_hits == ["window_update_burst"] and p.core.ended


def test_slow_reader_backlog_is_bounded_by_flow_control():
    p = Pair(limits=Limits(stream_buffer_low=1000))
    p.client.send_headers(1, REQUEST, end_stream=True)
    p.send()
    p.core.send_head(1, 200, [("content-type", "text/plain")])
    p.core.send_data(1, b"z" * 100_000)  # the client's default window is 65535
    assert p.core.backlog(1) == 100_000 - 65535
    assert not p.core.writable(1)
    received = sum(len(e.data) for e in p.back() if isinstance(e, h2.events.DataReceived))
    assert received == 65535
    p.client.increment_flow_control_window(40000)
    p.client.increment_flow_control_window(40000, stream_id=1)
    p.send()
    assert p.core.backlog(1) == 0 and p.core.writable(1)


def test_drain_finishes_open_streams_and_refuses_new_ones_before_any_goaway():
    p = Pair()
    p.client.send_headers(1, REQUEST, end_stream=True)
    p.send()
    p.core.start_drain()
    # No GOAWAY while stream 1 is open: httpcore raises on every open stream once one arrives.
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in p.back())
    assert not p.core.ended
    # The client opens stream 3 on the draining connection: refused, never started.
    p.client.send_headers(3, REQUEST, end_stream=True)
    assert p.send() == [] and p.heads[-1].stream_id == 1  # the gate never saw stream 3
    (refused,) = [e for e in p.back() if isinstance(e, h2.events.StreamReset)]
    assert refused.stream_id == 3 and refused.error_code == H2_REFUSED_STREAM
    assert not p.core.ended
    p.core.send_head(1, 200, [])
    p.core.send_data(1, b"done", end=True)
    assert p.core.ended  # the last stream finished: GOAWAY, and the connection closes itself
    got = p.back()
    assert [type(e) for e in got if isinstance(e, (h2.events.StreamEnded, h2.events.ConnectionTerminated))] == [
        h2.events.StreamEnded, h2.events.ConnectionTerminated]  # stream 1 ends before the GOAWAY
    goaway = next(e for e in got if isinstance(e, h2.events.ConnectionTerminated))
    assert goaway.error_code == H2_NO_ERROR and goaway.last_stream_id == 1  # not the refused 3
    assert b"".join(e.data for e in got if isinstance(e, h2.events.DataReceived)) == b"done"


def test_drain_with_no_open_stream_sends_goaway_at_once():
    p = Pair()
    p.client.send_headers(1, REQUEST, end_stream=True)
    p.send()
    p.core.send_head(1, 200, [])
    p.core.send_data(1, b"ok", end=True)
    p.back()
    p.core.start_drain()
    assert p.core.ended
    goaway = _goaway(p)
    assert goaway.error_code == H2_NO_ERROR and goaway.last_stream_id == 1


@pytest.mark.parametrize("who", ["client", "server"])
def test_drain_ends_when_the_last_stream_is_reset_by_either_side(who: str):
    p = Pair()
    p.client.send_headers(1, REQUEST, end_stream=True)
    p.send()
    p.core.send_head(1, 200, [])
    p.core.send_data(1, b"partial")
    p.core.start_drain()
    assert not p.core.ended
    if who == "client":
        p.client.reset_stream(1)
        events = p.send()
        assert any(isinstance(e, ConnectionEnded) for e in events)
    else:
        p.core.reset(1, 0x8)  # a preemption (CANCEL), e.g. at the drain deadline
    assert p.core.ended  # at once, not at the next timer tick
    goaway = _goaway(p)
    assert goaway.error_code == H2_NO_ERROR and goaway.last_stream_id == 1


def test_drain_deadline_close_sends_goaway_naming_the_last_stream_taken():
    p = Pair()
    p.client.send_headers(1, REQUEST, end_stream=True)
    p.send()
    p.core.start_drain()
    p.client.send_headers(3, REQUEST, end_stream=True)
    p.send()
    p.back()
    ended = p.core.close()  # the server's drain deadline: stream 1 never finished
    assert ended.error_code == H2_NO_ERROR and p.core.ended
    goaway = _goaway(p)
    assert goaway.error_code == H2_NO_ERROR and goaway.last_stream_id == 1


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"])
def test_bad_preface_ends_the_connection(garbage: bytes):
    core = CORE(lambda head: Accept(0), Limits())
    core.data_to_send()
    events = core.receive(garbage)
    assert any(isinstance(e, ConnectionEnded) for e in events) and core.ended


def test_window_updates_that_answer_our_data_are_not_a_flood():
    p = Pair(limits=Limits(window_update_burst=10, window_update_per_second=1))
    for i in range(40):  # a busy, well-behaved reader: every response acknowledged
        sid = 1 + 2 * i
        p.client.send_headers(sid, REQUEST, end_stream=True)
        p.send()
        p.core.send_head(sid, 200, [])
        p.core.send_data(sid, b"answer", end=True)
        for event in p.back():
            if isinstance(event, h2.events.DataReceived):
                p.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        p.send()
    assert p.limit_hits == [] and not p.core.ended


def test_server_core_config_field_picks_the_core(monkeypatch):
    import pathlib

    from zerolayer.runtime import config
    from zerolayer.runtime.config import parse_config
    from zerolayer.runtime.errors import ConfigError
    from zerolayer.runtime.serving.transport import h2_core_class

    # Unset: the compiled cores where their extension is installed (the image, CI), else the Python ones.
    assert parse_config({}, pathlib.Path(".")).server_core == "native"
    monkeypatch.setattr(config, "native_core_available", lambda: False)
    assert parse_config({}, pathlib.Path(".")).server_core == "python"
    monkeypatch.undo()
    assert parse_config({"server": {"core": "python"}}, pathlib.Path(".")).server_core == "python"
    assert parse_config({"server": {"core": "native"}}, pathlib.Path(".")).server_core == "native"
    assert h2_core_class("python") is H2ServerCore and h2_core_class("native") is NativeH2ServerCore
    with pytest.raises(ConfigError, match="server.core"):
        parse_config({"server": {"core": "rust"}}, pathlib.Path("."))


def test_window_overflow_on_a_stream_whose_answer_has_ended_is_a_flow_control_error():
    """h2spec 6.9.1/3 when the gate's refusal left before the WINDOW_UPDATEs came (RFC 9113 §6.9.1)."""
    p = Pair(verdict=lambda head: Reject(401, [], b"no"))
    p.client.send_headers(1, REQUEST)  # the body never comes: the stream stays open on the client's side
    p.send()
    assert any(isinstance(e, h2.events.StreamEnded) for e in p.back())  # the answer is complete
    p.send(b"".join(WindowUpdateFrame(1, window_increment=2**31 - 1).serialize() for _ in range(2)))
    frames = raw_frames(p.core.data_to_send())
    resets = [f for f in frames if isinstance(f, RstStreamFrame)]
    assert [(f.stream_id, f.error_code) for f in resets] == [(1, 0x3)]  # FLOW_CONTROL_ERROR
    assert not p.core.is_open(1) and not p.core.ended
