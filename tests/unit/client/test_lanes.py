"""Connections per node (``lanes.py``): a node served by K API processes gets K HTTP/2 connections, each
request on the one with the fewest in flight; the pure choice first, then the SDK against real HTTP/2
peers (h2peer.py) counting the connections it opened."""

from __future__ import annotations

import asyncio
import threading

import pytest
from h2peer import Reset, Respond, Stream, default_handler, sse_events

from zerolayer.client import AsyncClient, Client
from zerolayer.contract import H2_REFUSED_STREAM
from zerolayer.client.lanes import LaneWidth, Lanes, check_connections_per_node, origin
from zerolayer.client.nodes import Node, StaticNodeMap, node_from_status

pytestmark = pytest.mark.timeout(30)
HI = [{"role": "user", "content": "hi"}]
A, B = "http://10.0.0.1:8080", "http://10.0.0.2:8080"


# --------------------------------------------------------------------------- the node's count
@pytest.mark.parametrize("published, expected", [
    (2, 2), (1, 1), (64, 64), (None, None), (0, None), (-1, None), (True, None), (2.0, None), ("2", None),
    ([2], None),
])
def test_node_from_status_reads_api_processes(published, expected):
    status = {"endpoint": "10.0.0.1:8080", **({} if published is None else {"apiProcesses": published})}
    node = node_from_status("n", status)
    assert node is not None and node.api_processes == expected


# --------------------------------------------------------------------------- the width
@pytest.mark.parametrize("value", [0, -2, True, 1.5, "2"])
def test_connections_per_node_below_one_or_not_an_integer_is_refused(value):
    with pytest.raises(ValueError, match="connections_per_node must be an integer >= 1"):
        check_connections_per_node(value)
    with pytest.raises(ValueError, match="connections_per_node"):
        Client(api_key="k", base_url=A, connections_per_node=value)
    with pytest.raises(ValueError, match="connections_per_node"):
        AsyncClient(api_key="k", base_url=A, connections_per_node=value)


def test_width_is_the_node_s_count_unless_the_option_overrides_it():
    nodes = StaticNodeMap([Node("a", A, api_processes=3), Node("b", B), "10.0.0.3:8080"])
    width = LaneWidth(nodes)
    assert [width(A + "/v1/messages"), width(B + "/v1/messages"), width("http://10.0.0.3:8080/v1/messages")] == [3, 1, 1]
    assert width("http://fallback.example/v1/messages") == 1  # not a node of the map
    override = LaneWidth(nodes, connections_per_node=2)
    assert [override(A), override(B), override("http://10.0.0.3:8080"), override("http://fallback.example")] == [2, 2, 2, 1]


def test_width_follows_the_map():
    class Map:
        current: tuple[Node, ...] = (Node("a", A),)

        def nodes(self):
            return self.current

        def close(self) -> None:
            pass

    node_map = Map()
    width = LaneWidth(node_map)
    assert width(A) == 1
    node_map.current = (Node("a", A, api_processes=4),)
    assert width(A) == 4


def test_origins_default_the_port():
    assert origin("http://Node:80/v1/messages") == origin("http://node/x") == "http://node:80"
    assert origin("https://node/v1") == "https://node:443" != origin("http://node:443")


# --------------------------------------------------------------------------- the choice
def test_each_request_takes_the_lane_with_fewest_in_flight():
    lanes = Lanes(lambda url: 3)
    first = [lanes.take(A) for _ in range(3)]
    assert [lane.number for lane in first] == [0, 1, 2]  # all idle: round the lanes
    lanes.done(first[1])
    assert lanes.take(A).number == 1  # the only lane with none in flight
    lanes.done(first[0])
    lanes.done(first[2])
    assert lanes.in_flight(A) == [0, 1, 0]
    assert [lanes.take(A).number for _ in range(2)] == [2, 0]  # ties go round from after the last pick
    assert lanes.in_flight(A) == [1, 1, 1]


def test_sequential_requests_go_round_every_lane():
    lanes = Lanes(lambda url: 2)
    picks = []
    for _ in range(5):
        lane = lanes.take(A)
        picks.append(lane.number)
        lanes.done(lane)
    assert picks == [0, 1, 0, 1, 0]
    assert lanes.in_flight(A) == [0, 0]


def test_one_lane_is_always_lane_zero_and_origins_are_apart():
    lanes = Lanes(lambda url: 2 if url.startswith(A) else 1)
    assert [lanes.take(B + "/v1/messages").number for _ in range(3)] == [0, 0, 0]
    assert [lanes.take(A + "/v1/messages").number for _ in range(2)] == [0, 1]
    assert (lanes.in_flight(B), lanes.in_flight(A)) == ([3], [1, 1])


def test_a_shrinking_width_keeps_the_counts_right():
    width = {"k": 3}
    lanes = Lanes(lambda url: width["k"])
    held = [lanes.take(A) for _ in range(3)]
    width["k"] = 1
    assert lanes.take(A).number == 0
    for lane in held:
        lanes.done(lane)
    assert lanes.in_flight(A) == [1, 0, 0]


def test_lanes_are_thread_safe():
    lanes = Lanes(lambda url: 4)

    def work() -> None:
        for _ in range(2000):
            lanes.done(lanes.take(A))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lanes.in_flight(A) == [0, 0, 0, 0]


# --------------------------------------------------------------------------- over real sockets
def slow(req):  # noqa: ANN001 - h2peer handler
    return Respond(200, {"type": "message", "content": [{"type": "text", "text": str(req.connection)}]}, delay_s=0.2)


async def test_async_requests_spread_over_the_node_s_published_processes(peer):
    peer.handler = slow
    nodes = StaticNodeMap([Node("n", peer.url, api_processes=3)])
    async with AsyncClient(api_key="k", nodes=nodes, max_retries=0) as c:
        results = await asyncio.gather(*(c.messages.create(model="tiny", max_tokens=4, messages=HI) for _ in range(30)))
        pools = list(c._pool.pools)
    assert peer.connections == 3
    per_connection = [sum(1 for m in results if m.text == str(i)) for i in (1, 2, 3)]
    assert per_connection == [10, 10, 10]  # fewest in flight: an even spread
    assert len(pools) == 3 and all(p.is_closed for p in pools)  # the lanes close with the client


async def test_the_option_overrides_the_node_and_one_lane_is_one_connection(peers):
    one, two = peers(slow), peers(slow)
    async with AsyncClient(api_key="k", base_url=one.url, max_retries=0) as c:
        await asyncio.gather(*(c.messages.create(model="tiny", max_tokens=4, messages=HI) for _ in range(8)))
    assert one.connections == 1  # no count published, no option: one connection, as always
    nodes = StaticNodeMap([Node("n", two.url, api_processes=4)])
    async with AsyncClient(api_key="k", nodes=nodes, connections_per_node=2, max_retries=0) as c:
        await asyncio.gather(*(c.messages.create(model="tiny", max_tokens=4, messages=HI) for _ in range(8)))
    assert two.connections == 2


def test_sync_client_uses_every_lane_per_thread_and_streams_too(peer):
    with Client(api_key="k", base_url=peer.url, connections_per_node=2, max_retries=0) as c:
        for _ in range(4):
            c.messages.create(model="tiny", max_tokens=4, messages=HI)
        with c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True) as stream:
            assert "".join(stream.text_stream)
        thread_pool = c._pool._pool()
        assert thread_pool.lanes.in_flight(peer.url) == [0, 0]
    assert peer.connections == 2
    assert [r.connection for r in peer.requests] == [1, 2, 1, 2, 1]  # one at a time: round the lanes
    assert all(p.is_closed for p in thread_pool.pools) and len(thread_pool.pools) == 2


def test_sync_threads_keep_their_own_lanes(peer):
    with Client(api_key="k", base_url=peer.url, connections_per_node=2, max_retries=0) as c:
        def work() -> None:
            for _ in range(3):
                c.messages.create(model="tiny", max_tokens=4, messages=HI)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert peer.connections == 6  # 3 threads x 2 lanes (httpx's sync HTTP/2 is per thread, encode/httpx#3566)


# --------------------------------------------------------------------------- a draining connection
def drains_first_connection(req):  # noqa: ANN001 - h2peer handler
    """Connection 1 drains: its stream runs on (0.3 s), new streams are refused (REFUSED_STREAM)."""
    if req.connection != 1:
        return default_handler(req)
    if (req.json or {}).get("stream"):
        return Stream(sse_events(req, ["a"] * 6), delay_s=0.05)
    return Reset(H2_REFUSED_STREAM)


async def test_a_refused_stream_moves_the_lane_to_a_new_connection_while_the_old_one_finishes(peer):
    """What a runtime past server.max_connection_age_s does: the retry and later requests go on a new
    connection, the stream open on the old one completes, and the old pool closes after it."""
    peer.handler = drains_first_connection
    async with AsyncClient(api_key="k", base_url=peer.url, max_retries=1) as c:
        stream = await c.messages.create(model="tiny", max_tokens=8, messages=HI, stream=True)
        events = stream.__aiter__()
        seen = [await events.__anext__()]
        old = c._pool.pools[0]
        reply = await c.messages.create(model="tiny", max_tokens=4, messages=HI)  # refused on 1, then on 2
        assert reply.id.startswith("msg_2_") and c._pool.pools[0] is not old and not old.is_closed
        seen += [event async for event in events]
        assert seen[-1].type == "message_stop" and old.is_closed  # retired once its last request ended
        assert (await c.messages.create(model="tiny", max_tokens=4, messages=HI)).id.startswith("msg_2_")
    assert peer.connections == 2 and c._pool.pools[0].is_closed


def test_the_sync_client_moves_too(peer):
    peer.handler = drains_first_connection
    with Client(api_key="k", base_url=peer.url, max_retries=1) as c:
        with c.messages.create(model="tiny", max_tokens=8, messages=HI, stream=True) as stream:
            events = iter(stream)
            assert next(events).type == "message_start"
            old = c._pool._pool().pools[0]
            assert c.messages.create(model="tiny", max_tokens=4, messages=HI).id.startswith("msg_2_")
            rest = list(events)
            assert rest[-1].type == "message_stop" and sum(e.type == "content_block_delta" for e in rest) == 6
        assert old.is_closed and c._pool._pool().pools[0] is not old
        assert c.messages.create(model="tiny", max_tokens=4, messages=HI).id.startswith("msg_2_")
    assert peer.connections == 2
