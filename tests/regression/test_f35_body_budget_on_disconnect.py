"""Issue 28, item 1 (finding 35): a connection that drops mid-upload must give its buffered body back.

On 939d895, with ``max_tenant_buffered_body_bytes: 100000``, HEADERS with ``content-length: 100000``,
60,000 bytes of DATA and then a closed socket (RST, FIN, or GOAWAY then close; an RST on HTTP/1.1)
left the 60,000 bytes booked in the process's BodyBudget for good: the tenant's next complete
60 kB request was ``503 too many request bodies buffered``. ``Connection.connection_lost`` never
told the core, a peer GOAWAY only set ``ended``, and the HTTP/1.1 core released on EOF only.

The property test drives random interleavings of uploads, completions, resets, GOAWAYs, FINs and
RSTs over several connections and checks that the budget always equals the bytes actually held
in the cores' buffers (booked once, given back once) and is empty once every connection is gone.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.regression.wire import (
    KEY,
    H2Peer,
    chat_body,
    connect,
    h1_request,
    limits,
    peer_closes,
    runtime,
    turns,
    until,
)
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.protocol.h1conn import H1ServerCore
from zerolayer.runtime.protocol.h2conn import H2ServerCore

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]
CAP = 100_000
PART = 60_000


def _padded_body(size: int) -> bytes:
    """A valid chat request of exactly ``size`` bytes (JSON whitespace pads it)."""
    body = chat_body(stream=False, max_tokens=2)
    return body[:-1] + b" " * (size - len(body)) + b"}"


def _h2_partial_upload(peer: H2Peer) -> int:
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, [(":method", "POST"), (":path", "/v1/messages"), (":scheme", "http"),
                               (":authority", "node"), ("content-type", "application/json"),
                               ("content-length", str(CAP)), ("x-api-key", KEY)])
    sent = 0
    while sent < PART:
        step = min(peer.h2.max_outbound_frame_size, PART - sent)
        peer.h2.send_data(sid, b" " * step)
        sent += step
    peer.flush()
    return sid


async def _next_request_is_served(server) -> None:  # type: ignore[no-untyped-def]
    """The tenant's next complete 60 kB request is answered 200, not 503."""
    assert server.body_budget.total == 0, server.body_budget.by_owner
    conn, sock = connect(server, peer=("10.0.0.9", 41000))
    peer = H2Peer(conn, sock)
    sid = peer.request(_padded_body(PART))
    await until(lambda: peer.read() is not None and peer.status(sid) is not None)
    assert peer.status(sid) == 200, peer.body(sid)


async def _h2_dropped(how: str) -> None:
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=CAP))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    _h2_partial_upload(peer)
    assert server.body_budget.total == PART
    if how == "rst":
        conn.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
    elif how == "fin":
        peer_closes(conn, sock)
    else:  # GOAWAY, then the socket closes
        peer.h2.close_connection()
        peer.flush()
        await turns()
        conn.connection_lost(None)
    await turns()
    await _next_request_is_served(server)


@pytest.mark.parametrize("how", ["rst", "fin", "goaway"])
async def test_h2_upload_dropped_mid_body_gives_its_budget_back(how: str):
    await _h2_dropped(how)


async def test_h2_goaway_alone_gives_the_budget_back():
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=CAP))
    conn, sock = connect(server)
    peer = H2Peer(conn, sock)
    _h2_partial_upload(peer)
    peer.h2.close_connection()
    peer.flush()
    assert server.body_budget.total == 0  # nothing more will be read on that connection


@pytest.mark.parametrize("how", ["rst", "fin"])
async def test_http1_upload_dropped_mid_body_gives_its_budget_back(how: str):
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=CAP))
    conn, sock = connect(server)
    head = h1_request(b"x" * CAP)[:-CAP]
    conn.data_received(head + b" " * PART)
    assert server.body_budget.total == PART
    if how == "rst":
        conn.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
    else:
        peer_closes(conn, sock)
    await turns()
    await _next_request_is_served(server)


async def test_process_cap_is_not_eaten_by_abandoned_uploads_of_another_tenant():
    """With the process cap, abandoned uploads of one tenant must not starve another's request."""
    server = await runtime(limits=limits(max_tenant_buffered_body_bytes=CAP, max_buffered_body_bytes=2 * PART))
    for n in range(3):
        conn, sock = connect(server, peer=("10.0.0.7", 40000 + n))
        _h2_partial_upload(H2Peer(conn, sock))
        conn.connection_lost(ConnectionResetError())
    await turns()
    await _next_request_is_served(server)


# --------------------------------------------------------------------------- every end order
_OPS = st.lists(st.tuples(st.sampled_from(["open2", "open1", "data", "end", "rst_stream", "goaway",
                                           "fin", "rst", "close", "expire"]),
                          st.integers(0, 7), st.integers(1, 40_000)), max_size=60)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _held(cores: list) -> int:  # type: ignore[type-arg]
    total = 0
    for core in cores:
        if isinstance(core, H2ServerCore):
            total += sum(len(s.body) for s in core._streams.values())
        else:
            total += len(core._body)
    return total


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OPS)
def test_budget_is_booked_once_and_given_back_once_in_every_end_order(ops):
    """Sans-IO: both cores on one BodyBudget, driven through random end orders."""
    import h2.config
    import h2.connection

    from zerolayer.runtime.limits import BodyBudget
    from zerolayer.runtime.protocol.events import Accept

    lim = Limits(max_tenant_buffered_body_bytes=150_000, max_buffered_body_bytes=200_000, body_timeout_s=5)
    budget = BodyBudget.from_limits(lim)
    clock = _Clock()

    def gate(head):  # type: ignore[no-untyped-def]
        return Accept(context=None, max_body=lim.max_body_bytes, owner=head.headers.get("x-tenant", "a"))

    conns: list = []  # type: ignore[type-arg]  # (core, client or None, open stream ids)
    for kind, which, size in ops:
        clock.now += 0.5
        live = [c for c in conns if not c[0].ended]
        if kind == "open2" or (kind == "open1" and len(conns) % 2):
            core = H2ServerCore(gate, lim, clock=clock, budget=budget)
            client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            client.initiate_connection()
            core.receive(client.data_to_send())
            client.receive_data(core.data_to_send())
            conns.append([core, client, []])
        elif kind == "open1":
            core = H1ServerCore(gate, lim, clock=clock, budget=budget)
            core.receive(b"POST /v1/messages HTTP/1.1\r\nhost: n\r\nx-tenant: " + (b"a" if which % 2 else b"b")
                         + b"\r\ncontent-length: 1000000\r\n\r\n")
            conns.append([core, None, [1]])
        elif not live:
            continue
        else:
            entry = live[which % len(live)]
            core, client, sids = entry
            if kind == "data":
                if client is None:
                    core.receive(b"y" * size)
                else:
                    if not sids or which % 3 == 0:
                        sid = client.get_next_available_stream_id()
                        client.send_headers(sid, [(":method", "POST"), (":path", "/v1/messages"),
                                                  (":scheme", "http"), (":authority", "n"),
                                                  ("x-tenant", "a" if which % 2 else "b")])
                        sids.append(sid)
                    sid = sids[which % len(sids)]
                    try:
                        size = min(size, client.local_flow_control_window(sid))
                        client.send_data(sid, b"y" * size)
                    except Exception:
                        pass  # closed on the client's side already
                    core.receive(client.data_to_send())
            elif kind == "end" and client is not None and sids:
                try:
                    client.end_stream(sids[which % len(sids)])
                except Exception:
                    pass
                core.receive(client.data_to_send())
            elif kind == "rst_stream" and client is not None and sids:
                try:
                    client.reset_stream(sids[which % len(sids)])
                except Exception:
                    pass
                core.receive(client.data_to_send())
            elif kind == "goaway" and client is not None:
                client.close_connection()
                core.receive(client.data_to_send())
            elif kind == "fin" and client is None:
                core.receive(b"")
            elif kind in ("rst", "fin"):
                core.connection_lost()
            elif kind == "close":
                core.close()
                core.connection_lost()
            elif kind == "expire":
                clock.now += 3.0
                core.expire()
            if client is not None and not core.ended:
                try:
                    client.receive_data(core.data_to_send())
                except Exception:
                    pass
        assert budget.total >= 0
        assert budget.total == _held([c[0] for c in conns]), (kind, budget.total)
        assert sum(budget.by_owner.values()) == budget.total
    for core, _, _ in conns:
        core.connection_lost()
    assert budget.total == 0 and budget.by_owner == {}
