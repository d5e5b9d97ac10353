"""Fuzz the sans-IO HTTP/2 cores (runtime/protocol/h2conn.py and the native h2native.py) with raw frames and with hostile header blocks.

Contract: ``receive`` never raises. What the core writes is well-framed HTTP/2 (every frame parses
with hyperframe). A malformed frame sequence ends in GOAWAY (PROTOCOL_ERROR, FRAME_SIZE_ERROR,
COMPRESSION_ERROR, ENHANCE_YOUR_CALM, ...) or a RST_STREAM: RFC 9113 answers framing errors
there, not with a status. A request whose header block h2 accepts reaches the gate, and the
client gets the gate's status. Buffered body bytes all return to the shared budget once the
connection is closed.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack
import pytest
from hyperframe.frame import Frame, GoAwayFrame, SettingsFrame
from hypothesis import event, example, given
from hypothesis import strategies as st

from tests.fuzz.seeds import reproducible
from tests.fuzz.strategies import frame, raw_frames
from zerolayer.runtime.limits import BodyBudget, Limits
from zerolayer.runtime.protocol.events import Accept, ConnectionEnded, Reject, RequestReady, StreamAborted
from zerolayer.runtime.protocol.h2conn import PREFACE, H2ServerCore
from zerolayer.runtime.protocol.h2native import NativeH2ServerCore

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

LIMITS = Limits(max_header_count=8, max_continuation_frames=4, empty_frames_burst=5, rapid_reset_burst=5,
                max_queued_control_frames=8, window_update_burst=8, max_concurrent_streams=4)
CLIENT_SETTINGS = SettingsFrame(0).serialize()
GOAWAY_CODES = set(range(0, 0xE))  # RFC 9113 §7 error codes
# Every property runs against both cores: python-hyper h2 and the Rust h2 crate.
both_cores = pytest.mark.parametrize("core_cls", [H2ServerCore, NativeH2ServerCore], ids=["python", "native"])


def gate(head):  # type: ignore[no-untyped-def]
    if head.headers.get("x-api-key") != "k":
        return Reject(401, [("content-type", "application/json")], b'{"e":1}')
    return Accept(64, "ctx", owner="acme")


class Harness:
    """The core under test, a shared body budget, and everything it wrote, parsed into frames."""

    def __init__(self, core_cls: type = H2ServerCore) -> None:
        self.budget = BodyBudget.from_limits(LIMITS)
        self.core = core_cls(gate, LIMITS, budget=self.budget, clock=lambda: 1000.0)
        self.written = bytearray(self.core.data_to_send())
        self.events: list = []

    def feed(self, data: bytes) -> None:
        events = self.core.receive(data)
        for event in events:
            assert isinstance(event, (RequestReady, StreamAborted, ConnectionEnded)), event
            if isinstance(event, RequestReady):
                sid = event.head.stream_id
                assert sid % 2 == 1 and len(event.body) <= 64
                self.core.send_head(sid, 200, [("content-length", "2")])
                self.core.send_data(sid, b"ok", end=True)
        self.events += events
        self.written += self.core.data_to_send()

    def finish(self) -> list[Frame]:
        self.core.close()
        self.written += self.core.data_to_send()
        assert self.budget.total == 0 and not self.budget.by_owner, "buffered body bytes leaked from the budget"
        return parse_frames(bytes(self.written))


def parse_frames(data: bytes) -> list[Frame]:
    frames, at = [], 0
    while at < len(data):
        assert len(data) - at >= 9, "a truncated frame header"
        f, length = Frame.parse_frame_header(memoryview(data[at:at + 9]))
        assert len(data) - at - 9 >= length, "a truncated frame body"
        f.parse_body(memoryview(data[at + 9:at + 9 + length]))
        frames.append(f)
        at += 9 + length
    return frames


def headers_frame(sid: int, extra: list[tuple[bytes, bytes]], flags: int) -> bytes:
    """A HEADERS frame whose block is valid HPACK (fresh encoder: no dynamic-table references)."""
    return frame(0x1, flags, sid, hpack.Encoder().encode(REQUEST + extra))


@st.composite
def conversations(draw):  # type: ignore[no-untyped-def]
    """Mostly-valid request sequences (streams 1, 3, 5, ... with bodies) with raw frames spliced in."""
    frames: list[bytes] = []
    for sid in range(1, 2 * draw(st.integers(1, 5)), 2):
        extra = draw(st.lists(st.sampled_from([(b"x-zerolayer-priority", b"high"), (b"te", b"trailers"), (b"x", b"1"),
                                               (b"x-api-key", b"wrong"), (b"content-length", b"3"),
                                               (b"te", b"gzip"), (b"connection", b"close")]), max_size=2))
        body = draw(st.binary(max_size=80))
        frames.append(headers_frame(sid, extra, 0x4 | (0 if body else draw(st.sampled_from([1, 1, 1, 0])))))
        if body:
            frames.append(frame(0x0, draw(st.sampled_from([1, 1, 1, 0])), sid, body))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        frames.insert(draw(st.integers(0, len(frames))), draw(raw_frames))
    return frames


@both_cores
@reproducible
@given(frames=st.one_of(conversations(), st.lists(raw_frames, max_size=12)),
       cuts=st.lists(st.integers(1, 50), max_size=6))
@example(frames=[frame(0x1, 0x4, 1, b"\x82\x86\x84\x41\x8a\x08\x9d\x5c\x0b\x81\x70\xdc\x78\x0f\x03")] * 3, cuts=[])
@example(frames=[frame(0x9, 0x4, 1, b"")], cuts=[])  # CONTINUATION with no open header block
@example(frames=[frame(0x1, 0x0, 1, b"\x82")] + [frame(0x9, 0x0, 1, b"")] * 10, cuts=[])  # CONTINUATION flood
@example(frames=[frame(0x4, 0x0, 0, b"\x00\x04\xff\xff\xff\xff")], cuts=[])  # INITIAL_WINDOW_SIZE over 2^31-1
@example(frames=[frame(0x0, 0x1, 1, b"x", length=2**24 - 1)], cuts=[])  # a length far past MAX_FRAME_SIZE
def test_raw_frames_after_the_preface_never_crash_the_core(core_cls, frames, cuts):
    harness = Harness(core_cls)
    data = PREFACE + CLIENT_SETTINGS + b"".join(frames)
    at = 0
    for cut in [*cuts, len(data)]:
        harness.feed(data[at:at + cut])
        at += cut
    event(f"requests served: {min(3, sum(isinstance(e, RequestReady) for e in harness.events))}")
    for f in harness.finish():
        if isinstance(f, GoAwayFrame):
            assert f.error_code in GOAWAY_CODES
            event(f"goaway {f.error_code}")  # --hypothesis-show-statistics shows how inputs ended


# Header blocks built by a client with its own checks off: names and values h2 would never send.
header_names = st.one_of(
    st.sampled_from([":method", ":path", ":scheme", ":authority", ":status", ":protocol", ":bogus", "x-api-key",
                     "content-length", "connection", "te", "host", "transfer-encoding", "Upper", "x-zerolayer-priority"]),
    st.from_regex(r"\A[a-z0-9-]{1,12}\Z"),
    st.from_regex(r"\A[a-z0-9-]{1,12}\Z"),
    st.from_regex(r"\A[a-z0-9-]{1,12}\Z"),
    st.binary(min_size=0, max_size=12),
)
header_values = st.one_of(st.sampled_from([b"", b"k", b"POST", b"GET", b"/", b"http", b"trailers", b"5", b"-1",
                                           b"a\r\nb", b"\x00", b" k"]),
                          st.from_regex(rb"\A[!-~]([ -~]{0,18}[!-~])?\Z"), st.from_regex(rb"\A[!-~]{0,20}\Z"),
                          st.binary(max_size=20))
header_blocks = st.lists(st.tuples(header_names.map(lambda n: n.encode() if isinstance(n, str) else n), header_values),
                         max_size=5)
REQUEST = [(b":method", b"POST"), (b":path", b"/v1/messages"), (b":scheme", b"http"), (b":authority", b"node"),
           (b"x-api-key", b"k")]


@both_cores
@reproducible
@given(extra=header_blocks, keep=st.lists(st.sampled_from([True, True, True, False]), min_size=5, max_size=5), body=st.binary(max_size=100),
       end=st.booleans())
@example(extra=[(b"content-length", b"5")], keep=[True] * 5, body=b"123", end=True)  # length disagrees with DATA
@example(extra=[(b"te", b"gzip")], keep=[True] * 5, body=b"", end=True)
@example(extra=[(b":path", b"/again")], keep=[True] * 5, body=b"", end=True)  # duplicate pseudo-header
@example(extra=[(b"x", b"1")] * 9, keep=[True] * 5, body=b"", end=True)  # over max_header_count
def test_hostile_header_blocks_reach_the_gate_or_are_reset(core_cls, extra, keep, body, end):
    """Requests with missing, repeated or forbidden pseudo-headers, connection-specific fields, bad bytes."""
    harness = Harness(core_cls)
    config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                       normalize_outbound_headers=False, validate_inbound_headers=False)
    client = h2.connection.H2Connection(config)
    client.initiate_connection()
    block = [h for h, k in zip(REQUEST, keep) if k] + extra or [(b"x", b"1")]  # h2's client fails on an empty block
    client.send_headers(1, block, end_stream=not body and end)
    if body:
        client.send_data(1, body[:64], end_stream=end)
    harness.feed(client.data_to_send())
    frames = harness.finish()
    try:
        events = client.receive_data(bytes(harness.written))
    except h2.exceptions.ProtocolError as exc:  # the client's own view of the server's bytes must be valid
        raise AssertionError(f"the server's answer is not valid HTTP/2: {exc}") from exc
    status = next((int(dict(e.headers)[b":status"]) for e in events if isinstance(e, h2.events.ResponseReceived)), None)
    reset = any(isinstance(e, h2.events.StreamReset) for e in events)
    goaway = next((f for f in frames if isinstance(f, GoAwayFrame)), None)
    event(f"status {status}" if status is not None else "reset" if reset else "goaway or open")
    if status is not None:
        assert status in (200, 401, 413, 431) or 400 <= status < 500, status
    else:
        # No answer: the block was malformed (RST_STREAM / GOAWAY PROTOCOL_ERROR) or is still open.
        assert reset or (goaway is not None and goaway.error_code != 0) or not end, (block, frames)
