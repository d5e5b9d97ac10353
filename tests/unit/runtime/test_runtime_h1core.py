"""The sans-IO HTTP/1.1 core: same gate-before-body contract as HTTP/2."""

from __future__ import annotations

import h11
import pytest

from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol import h1conn
from zerolayer.runtime.protocol.events import Accept, ConnectionEnded, Reject, RequestReady
from zerolayer.runtime.protocol.h1native import NativeH1ServerCore

CORES = {"python": h1conn.H1ServerCore, "native": NativeH1ServerCore}


@pytest.fixture(params=sorted(CORES), autouse=True)
def core_cls(request):  # type: ignore[no-untyped-def]
    """Every test runs against both cores: the tests construct ``H1ServerCore``, bound here."""
    global H1ServerCore
    H1ServerCore = CORES[request.param]
    yield H1ServerCore
    H1ServerCore = h1conn.H1ServerCore


H1ServerCore = h1conn.H1ServerCore


def request(body: bytes, path: str = "/v1/messages", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: node\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body


def parse_responses(data: bytes) -> list[object]:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    out = []
    while True:
        event = client.next_event()
        if event in (h11.NEED_DATA, h11.PAUSED):
            return out
        out.append(event)
        if isinstance(event, h11.EndOfMessage):
            return out


def test_accepted_request_is_ready_with_body():
    heads = []
    core = H1ServerCore(lambda head: heads.append(head) or Accept(1000, "ctx"), Limits())
    (ready,) = core.receive(request(b'{"x":1}', extra="x-api-key: k\r\n"))
    assert isinstance(ready, RequestReady) and ready.body == b'{"x":1}' and ready.context == "ctx"
    assert heads[0].headers["x-api-key"] == "k" and heads[0].http_version == "1.1"
    core.send_head(ready.head.stream_id, 200, [("content-length", "2")])
    core.send_data(ready.head.stream_id, b"ok", end=True)
    events = parse_responses(core.data_to_send())
    assert events[0].status_code == 200


def test_rejected_request_body_is_not_kept_and_the_connection_closes():
    seen = []

    def gate(head):  # type: ignore[no-untyped-def]
        seen.append(core.discarded_body_bytes)
        return Reject(401, [("x-zerolayer-error", "AUTHENTICATION")], b"{}")

    core = H1ServerCore(gate, Limits())
    body = b"z" * 5000
    raw = request(body)
    events = core.receive(raw[:200]) + core.receive(raw[200:])
    assert not any(isinstance(e, RequestReady) for e in events)
    assert seen == [0]
    response = parse_responses(core.data_to_send())[0]
    assert response.status_code == 401
    assert (b"connection", b"close") in response.headers
    assert core.ended  # closing instead of reading a body nobody will use


def test_two_requests_on_one_connection_are_served_in_turn():
    core = H1ServerCore(lambda head: Accept(100, head.path), Limits())
    (first,) = core.receive(request(b"{}", "/a") + request(b"{}", "/b"))
    assert first.context == "/a"
    core.send_head(first.head.stream_id, 200, [("content-length", "0")])
    core.send_data(first.head.stream_id, b"", end=True)
    (second,) = core.resume()
    assert second.context == "/b" and second.head.stream_id != first.head.stream_id


def test_too_many_headers_get_431():
    hits = []
    core = H1ServerCore(lambda head: Accept(0), Limits(max_header_count=3), on_limit=hits.append)
    extra = "".join(f"x-h{i}: v\r\n" for i in range(5))
    assert core.receive(request(b"", extra=extra)) == []
    assert parse_responses(core.data_to_send())[0].status_code == 431
    assert hits == ["max_header_count"]


def test_garbage_gets_400_and_closes():
    core = H1ServerCore(lambda head: Accept(0), Limits())
    events = core.receive(b"\x16\x03\x01 not http\r\n\r\n")
    assert any(isinstance(e, ConnectionEnded) for e in events)
    assert b"400" in core.data_to_send()[:20]


def test_protocol_sniffing():
    from zerolayer.runtime.serving.transport import sniff_protocol

    assert sniff_protocol(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == "2"
    assert sniff_protocol(b"PRI * HT") is None  # could still be the preface
    assert sniff_protocol(b"POST /v1/messages HTTP/1.1\r\n") == "1.1"
    assert sniff_protocol(b"GET / HTTP/1.0\n") == "1.1"
    assert sniff_protocol(b"POST /v1/mess") is None
    assert sniff_protocol(b"INVALID CONNECTION PREFACE\r\n\r\n") == "2"  # h2 core closes it


def test_drain_before_the_response_head_answers_with_connection_close_then_ends():
    core = H1ServerCore(lambda head: Accept(100, "ctx"), Limits())
    (ready,) = core.receive(request(b"{}"))
    core.start_drain()
    assert not core.ended  # the request in flight is answered first
    core.send_head(ready.head.stream_id, 200, [("content-length", "2")])
    core.send_data(ready.head.stream_id, b"ok", end=True)
    events = parse_responses(core.data_to_send())
    assert events[0].status_code == 200 and (b"connection", b"close") in events[0].headers
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"ok"
    assert core.ended


def test_drain_during_a_streamed_response_lets_it_finish_then_ends():
    core = H1ServerCore(lambda head: Accept(100, "ctx"), Limits())
    (ready,) = core.receive(request(b"{}"))
    sid = ready.head.stream_id
    core.send_head(sid, 200, [("content-type", "text/event-stream")])  # chunked, under way
    core.send_data(sid, b"data: 1\n\n")
    core.start_drain()
    assert not core.ended  # nothing cuts the response short
    core.send_data(sid, b"data: 2\n\n", end=True)
    events = parse_responses(core.data_to_send())
    assert (b"connection", b"close") not in events[0].headers  # the head left before the drain
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"data: 1\n\ndata: 2\n\n"
    assert isinstance(events[-1], h11.EndOfMessage) and core.ended


def test_drain_of_an_idle_connection_ends_it_at_once():
    core = H1ServerCore(lambda head: Accept(100, "ctx"), Limits())
    core.start_drain()
    assert core.ended and core.data_to_send() == b""


def test_a_head_still_incomplete_past_the_limit_gets_431_and_closes():
    hits = []
    core = H1ServerCore(lambda head: Accept(0), Limits(max_header_list_size=1024), on_limit=hits.append)
    raw = b"GET /v1/models HTTP/1.1\r\nhost: node\r\nx-padding: " + b"a" * 3000
    events = []
    for at in range(0, len(raw), 100):
        events += core.receive(raw[at:at + 100])
        if core.ended:
            break
    assert any(isinstance(e, ConnectionEnded) for e in events) and core.ended
    assert parse_responses(core.data_to_send())[0].status_code == 431
    assert hits == ["max_header_list_size"]
