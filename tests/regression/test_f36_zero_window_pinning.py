"""Issue 28, item 2 (finding 36): a peer that never opens its window must not pin a connection.

On 939d895 an h2c peer with ``SETTINGS_INITIAL_WINDOW_SIZE=0`` sent ``GET /healthz`` (END_STREAM,
no key) ten times and never a WINDOW_UPDATE: the connection stayed open past the idle timeout
(``idle_timeout_s: 6``, ``write_timeout_s: 4``: still open after 26 s), so twenty such connections
filled ``max_connections: 20`` and locked out a valid key from a third address. The core never
expired an accepted stream whose response waited for window, the stream counted as open so the
keepalive skipped the idle close, and ``end()`` bypassed ``wait_writable``.

The HTTP/1.1 variant is a peer that stops reading the socket: once the idle timeout closed the
connection, asyncio's ``close()`` waited for the unread response to drain, forever, so
``connection_lost`` never came and the connection's slot in the PeerLedger was never freed.
"""

from __future__ import annotations

import h2.settings
import pytest

from tests.regression.wire import H2Peer, chat_body, connect, h1_request, limits, runtime, until

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]


def _zero_window_peer(conn, sock) -> H2Peer:  # type: ignore[no-untyped-def]
    peer = H2Peer(conn, sock)
    peer.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    peer.flush()
    peer.read()
    return peer


async def test_h2_zero_window_streams_are_reset_and_the_idle_connection_closed():
    server = await runtime(limits=limits(idle_timeout_s=1.0, write_timeout_s=0.5, ping_interval_s=0.5))
    conn, sock = connect(server)
    peer = _zero_window_peer(conn, sock)
    sids = [peer.request(None, path="/healthz", key=None) for _ in range(10)]
    await until(lambda: peer.read() is not None and all(peer.status(s) == 200 for s in sids))
    assert conn.core.open_streams == 10  # answered, but no body byte may leave: window 0
    await until(lambda: conn.core.open_streams == 0, timeout=5)
    await until(lambda: sock.lost, timeout=8)
    assert server.peers.total == 0


async def test_h2_zero_window_connections_do_not_lock_out_a_valid_key():
    server = await runtime(limits=limits(idle_timeout_s=1.0, write_timeout_s=0.5, ping_interval_s=0.5,
                                         max_connections=4))
    pinned = []
    for n in range(4):
        conn, sock = connect(server, peer=(f"10.0.0.{n % 2 + 1}", 40000 + n))
        peer = _zero_window_peer(conn, sock)
        for _ in range(3):
            peer.request(None, path="/healthz", key=None)
        pinned.append(sock)
    assert server.peers.total == 4
    await until(lambda: all(s.lost for s in pinned), timeout=10)
    conn, sock = connect(server, peer=("10.0.0.3", 50000))
    assert not sock.closing, "refused: the pinned connections still fill max_connections"
    peer = H2Peer(conn, sock)
    sid = peer.request(chat_body(stream=False, max_tokens=2))
    await until(lambda: peer.read() is not None and peer.status(sid) is not None)
    assert peer.status(sid) == 200


async def test_h2_window_that_opens_in_time_is_not_cut_off():
    server = await runtime(limits=limits(write_timeout_s=0.5))
    conn, sock = connect(server)
    peer = _zero_window_peer(conn, sock)
    sid = peer.request(None, path="/healthz", key=None)
    await until(lambda: peer.read() is not None and peer.status(sid) == 200)
    peer.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535})
    peer.flush()
    await until(lambda: peer.read() is not None and conn.core.open_streams == 0)
    assert peer.reset_code(sid) is None and peer.body(sid)


async def test_http1_peer_that_never_reads_is_aborted_after_close():
    server = await runtime(limits=limits(idle_timeout_s=1.0, write_timeout_s=0.5, ping_interval_s=0.5))
    conn, sock = connect(server, high_water=64)
    sock.holds_unread = True
    conn.data_received(h1_request(b"", path="/healthz", key="").replace(b"POST", b"GET"))
    await until(lambda: sock.paused)  # the response sits unread in the socket buffer
    await until(lambda: sock.closing, timeout=5)  # the idle timeout closes it...
    await until(lambda: sock.lost, timeout=5)  # ...and the unread bytes do not hold it open
    assert server.peers.total == 0
