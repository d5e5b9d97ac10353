"""Finding 1: a client disconnecting mid-stream must not leak its quota reservation.

On 410a271 the peer's FIN (HTTP/1.1) or RST_STREAM-then-FIN (HTTP/2) cancelled the serving task
twice; the second cancel landed on the awaited engine abort and ``settle`` never ran, so after
``max_concurrent_streams`` disconnects the tenant got 429 until the runtime restarted.
"""

from __future__ import annotations

import pytest

from tests.regression.wire import H2Peer, chat_body, connect, h1_request, peer_closes, runtime, turns, until

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
LIMIT = 3
CORES = pytest.mark.parametrize("core", ["python", "native"])  # server.core: the HTTP/1.1 core too


@CORES
async def test_http1_disconnects_mid_stream_settle_every_reservation(core):
    server = await runtime(max_concurrent_streams=LIMIT, server_core=core)
    for n in range(LIMIT + 1):
        conn, sock = connect(server)
        conn.data_received(h1_request(chat_body()))
        await until(lambda: b"\r\n\r\n" in sock.written)
        assert sock.written.startswith(b"HTTP/1.1 200"), f"disconnect #{n + 1}: {bytes(sock.written[:300])!r}"
        await until(lambda: b"content_block_delta" in sock.written)
        peer_closes(conn, sock)
        await turns(10)
    assert server.scheduler.open_streams() == 0
    assert server.app.streams == {}
    conn, sock = connect(server)
    conn.data_received(h1_request(chat_body(stream=False, max_tokens=2)))
    await until(lambda: b"\r\n\r\n" in sock.written)
    assert sock.written.startswith(b"HTTP/1.1 200"), bytes(sock.written[:200])


async def test_http2_rst_stream_then_close_settles_the_reservation():
    server = await runtime(max_concurrent_streams=LIMIT)
    for n in range(LIMIT + 1):
        conn, sock = connect(server)
        peer = H2Peer(conn, sock)
        sid = peer.request(chat_body())
        await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
        assert peer.status(sid) == 200, f"disconnect #{n + 1}: {peer.body(sid)!r}"
        await until(lambda: (peer.read(), b"content_block_delta" in peer.body(sid))[1])
        peer.h2.reset_stream(sid, 8)
        peer.flush()
        peer_closes(conn, sock)
        await turns(10)
    assert server.scheduler.open_streams() == 0
    assert server.app.streams == {}
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(stream=False, max_tokens=2))
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    assert peer.status(sid) == 200, peer.body(sid)
