"""Issue 28, item 5 (finding 39): the 64 KiB header limit holds for a head that arrives whole.

On 939d895 the HTTP/1.1 core relied on h11's ``max_incomplete_event_size``, which bounds only a
head still incomplete: a 70 kB header, or a 100 kB trailer, sent in one write was answered 200,
and only 200 kB got 431. Now the request head and the trailers are measured as HTTP/2 measures a
header list (name + value + 32 each) against ``max_header_list_size``: 431, connection closed.
HTTP/2 was already bounded by hpack's decoder (checked here too).
"""

from __future__ import annotations

import pytest

from tests.regression.wire import KEY, H2Peer, chat_body, connect, h1_request, runtime, until

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
BIG = "a" * 70_000
CORES = pytest.mark.parametrize("core", ["python", "native"])  # server.core: the HTTP/1.1 core too


def _status(written: bytes) -> int:
    return int(written.split(b" ", 2)[1])


@CORES
async def test_http1_70kb_header_in_one_write_is_431(core):
    server = await runtime(server_core=core)
    conn, sock = connect(server)
    conn.data_received(h1_request(chat_body(stream=False, max_tokens=2), extra=[("x-padding", BIG)]))
    await until(lambda: b"\r\n\r\n" in sock.written)
    assert _status(bytes(sock.written)) == 431, bytes(sock.written[:200])
    assert server.app.streams == {}


@CORES
async def test_http1_100kb_trailer_in_one_write_is_431(core):
    server = await runtime(server_core=core)
    conn, sock = connect(server)
    body = chat_body(stream=False, max_tokens=2)
    head = (f"POST /v1/messages HTTP/1.1\r\nhost: node\r\ncontent-type: application/json\r\n"
            f"x-api-key: {KEY}\r\ntransfer-encoding: chunked\r\n\r\n").encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n" + b"x-trailer: " + b"t" * 100_000 + b"\r\n\r\n"
    conn.data_received(head + chunked)
    await until(lambda: b"\r\n\r\n" in sock.written)
    assert _status(bytes(sock.written)) == 431, bytes(sock.written[:200])
    await until(lambda: server.scheduler.open_streams() == 0)
    assert server.body_budget.total == 0


@CORES
async def test_http1_head_under_the_limit_is_served(core):
    server = await runtime(server_core=core)
    conn, sock = connect(server)
    conn.data_received(h1_request(chat_body(stream=False, max_tokens=2), extra=[("x-padding", "a" * 60_000)]))
    await until(lambda: b"\r\n\r\n" in sock.written)
    assert _status(bytes(sock.written)) == 200, bytes(sock.written[:200])


async def test_h2_70kb_header_is_refused():
    server = await runtime()
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(stream=False, max_tokens=2), extra=[("x-padding", BIG)])
    peer.read()
    assert peer.status(sid) != 200 and (peer.goaway() is not None or peer.reset_code(sid) is not None
                                        or peer.status(sid) == 431)
