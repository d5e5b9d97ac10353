"""Finding 2: connections must not be pinned forever (slowloris), with or without an API key.

On 410a271: a rejected stream without END_STREAM stayed in the core's stream table, so the
keep-alive loop never idle-closed its connection; an accepted body could trickle in forever;
a header block could stay incomplete forever; nothing capped connections per process or per
peer, or the bytes of request bodies buffered at once.
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import pytest

from tests.regression.wire import (KEY, H2Peer, chat_body, connect, h1_request, limits, runtime, turns,
                                   until)
from zerolayer.runtime.protocol.events import Reject
from zerolayer.runtime.protocol.h2conn import H2ServerCore

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
REQUEST = [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"), (":authority", "node")]


def test_a_rejected_stream_without_end_stream_is_not_an_open_stream():
    core = H2ServerCore(lambda head: Reject(401, [], b"no key"))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST + [("x-api-key", "wrong")])  # no END_STREAM, body never comes
    core.receive(client.data_to_send())
    client.receive_data(core.data_to_send())
    assert core.open_streams == 0


async def test_a_connection_holding_only_a_rejected_stream_is_idle_closed():
    server = await runtime(limits=limits(idle_timeout_s=0.3, ping_interval_s=0.1))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(), key="sk-wrong", end=False)
    peer.read()
    assert peer.status(sid) == 401
    await until(lambda: sock.closing, timeout=3)


async def test_an_accepted_body_that_never_completes_is_answered_408_and_settled():
    server = await runtime(limits=limits(body_timeout_s=0.3, idle_timeout_s=60, ping_interval_s=30))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    body = chat_body()
    sid = peer.request(body[:10], end=False)  # accepted at HEADERS, the rest never comes
    assert server.scheduler.open_streams() == 1
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None, timeout=3)
    assert peer.status(sid) == 408
    await turns()
    assert server.scheduler.open_streams() == 0 and server.app.streams == {}
    assert not sock.closing  # only the stream is stopped, not the connection


async def test_an_http1_body_that_never_completes_is_answered_408_and_settled():
    server = await runtime(limits=limits(body_timeout_s=0.3, idle_timeout_s=60, ping_interval_s=30))
    conn, sock = connect(server)
    conn.data_received(h1_request(chat_body())[:-10])
    assert server.scheduler.open_streams() == 1
    await until(lambda: sock.written.startswith(b"HTTP/1.1 408"), timeout=3)
    await turns()
    assert server.scheduler.open_streams() == 0 and server.app.streams == {}


async def test_an_http1_request_head_that_never_completes_is_closed():
    server = await runtime(limits=limits(header_timeout_s=0.3, idle_timeout_s=60, ping_interval_s=30))
    conn, sock = connect(server)
    conn.data_received(b"POST /v1/messages HTTP/1.1\r\nhost: node\r\nx-slow: ")
    await until(lambda: sock.closing, timeout=3)
    assert sock.written.startswith(b"HTTP/1.1 408")


async def test_an_h2_header_block_that_never_completes_is_closed():
    server = await runtime(limits=limits(header_timeout_s=0.3, idle_timeout_s=60, ping_interval_s=30))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    peer.read()
    from hyperframe.frame import HeadersFrame

    frame = HeadersFrame(1)
    frame.data = peer.h2.encoder.encode(REQUEST + [("x-api-key", KEY)])
    frame.flags.add("END_STREAM")  # END_HEADERS never comes: CONTINUATION frames are awaited
    conn.data_received(frame.serialize())
    await until(lambda: sock.closing, timeout=3)
    peer.read()
    assert peer.goaway() is not None


async def test_connections_are_capped_per_peer_and_per_process():
    server = await runtime(limits=limits(max_connections=3, max_connections_per_peer=2))
    a1, s1 = connect(server, ("10.0.0.1", 1))
    a2, s2 = connect(server, ("10.0.0.1", 2))
    a3, s3 = connect(server, ("10.0.0.1", 3))  # a third from the same peer
    assert not s1.closing and not s2.closing and s3.closing
    await turns()
    b1, t1 = connect(server, ("10.0.0.2", 1))  # another peer: fine, that is 3 in all
    c1, u1 = connect(server, ("10.0.0.3", 1))  # a fourth connection: over the process cap
    assert not t1.closing and u1.closing
    await turns()
    s1.close()
    await turns()
    d1, v1 = connect(server, ("10.0.0.1", 4))  # the first peer's slot came back
    assert not v1.closing


async def test_buffered_request_bodies_are_capped_per_tenant():
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=100_000,
                                         max_buffered_body_bytes=1_000_000))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    first = peer.request(b"x" * 60_000, end=False)
    second = peer.request(b"x" * 60_000, end=False)  # 120 kB of one tenant's bodies held at once
    peer.read()
    assert peer.status(first) is None
    assert peer.status(second) == 503
    await turns()
    assert server.scheduler.open_streams() == 1  # the refused stream was settled


async def test_buffered_request_bodies_are_capped_per_process():
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=1_000_000,
                                         max_buffered_body_bytes=100_000))
    one, sock_one = connect(server, ("10.0.0.1", 1))
    two, sock_two = connect(server, ("10.0.0.2", 1))
    p1, p2 = H2Peer(one, sock_one), H2Peer(two, sock_two)
    s1 = p1.request(b"x" * 60_000, end=False)
    s2 = p2.request(b"x" * 60_000, end=False)
    p1.read(), p2.read()
    assert p1.status(s1) is None and p2.status(s2) == 503
    await turns()
    assert server.scheduler.open_streams() == 1
    # once the first body completes and leaves the buffer, a new one fits again
    p1.h2.end_stream(s1)
    p1.flush()
    s3 = p2.request(b"x" * 60_000, end=False)
    p2.read()
    assert p2.status(s3) is None
    await asyncio.sleep(0)
