"""Finding 17: a peer that stops reading must not hold its stream (and the tenant's slot) forever.

On 410a271 a producer blocked on flow control (HTTP/2) or on a full socket buffer (HTTP/1.1)
waited with no time limit, so a client that stopped reading held its stream, its quota
reservation and its engine work until it went away.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.regression.wire import H2Peer, chat_body, connect, h1_request, limits, runtime, until
from zerolayer.runtime.engine.synthetic import SyntheticEngine

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]
CORES = pytest.mark.parametrize("core", ["python", "native"])  # server.core: the HTTP/1.1 core too


def chatty() -> SyntheticEngine:
    return SyntheticEngine(output_tokens=20_000)  # ~2 MB of SSE: far more than any window or buffer


async def test_h2_stream_whose_peer_stops_reading_is_reset_and_settled():
    server = await runtime(engine=chatty(), limits=limits(write_timeout_s=0.3))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    peer.request(chat_body(max_tokens=20_000))
    # The peer never reads again: no WINDOW_UPDATE, the stream's 64 KiB window fills.
    await until(lambda: server.app.streams and next(iter(server.app.streams.values())).output_tokens > 100)
    await until(lambda: server.scheduler.open_streams() == 0, timeout=5)
    assert server.app.streams == {}
    assert not sock.closing  # only the stream went, not the connection


@CORES
async def test_http1_response_whose_peer_stops_reading_is_closed_and_settled(core):
    server = await runtime(engine=chatty(), limits=limits(write_timeout_s=0.3), server_core=core)
    conn, sock = connect(server, high_water=64 * 1024)
    conn.data_received(h1_request(chat_body(max_tokens=20_000)))
    await until(lambda: sock.paused)  # the socket buffer is full; the peer reads nothing
    await until(lambda: server.scheduler.open_streams() == 0, timeout=5)
    assert server.app.streams == {}
    assert sock.eof_written or sock.closing  # HTTP/1.1 has no stream reset: the connection ends


async def test_a_slow_but_steady_reader_is_not_cut_off():
    server = await runtime(engine=SyntheticEngine(output_tokens=3000), limits=limits(write_timeout_s=0.3))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(max_tokens=3000))
    for _ in range(200):  # reads a little every 0.1 s: progress within every write timeout
        await asyncio.sleep(0.1)
        peer.read()
        if peer.body(sid).endswith(b"message_stop\"}\n\n"):
            break
    assert peer.status(sid) == 200 and peer.reset_code(sid) is None
    assert b"message_stop" in peer.body(sid)
