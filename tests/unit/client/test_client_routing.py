"""Node choice, the GPU-map sources and the circuit breaker."""

from __future__ import annotations

import pytest

from zerolayer.client import errors
from zerolayer.client.events import CircuitClosed, CircuitHalfOpen, FallbackTriggered
from zerolayer.client.nodes import HashRing, HttpNodeMap, Node, StaticNodeMap, node_from_status, nodes_from_document
from zerolayer.client.routing import BreakerState, CircuitBreaker, Router


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ring_is_affine_and_moves_few_sessions():
    five = HashRing([f"n{i}" for i in range(5)])
    four = HashRing([f"n{i}" for i in range(4)])
    sessions = [f"s{i}" for i in range(2000)]
    owner5 = {s: next(five.walk(s)) for s in sessions}
    owner4 = {s: next(four.walk(s)) for s in sessions}
    assert owner5 == {s: next(five.walk(s)) for s in sessions}  # stable
    moved = [s for s in sessions if owner5[s] != owner4[s]]
    assert all(owner5[s] == "n4" for s in moved)  # only the removed node's sessions move
    assert 0.1 < len(moved) / len(sessions) < 0.3  # ~1/5
    assert sorted(five.walk("x")) == [f"n{i}" for i in range(5)]


def nodes_router(nodes, **kw):
    clock = Clock()
    wall = Clock(50_000.0)

    class Map:
        def __init__(self):
            self.items = list(nodes)

        def nodes(self):
            return self.items

        def close(self):
            pass

    events = []
    router = Router(Map(), clock=clock, wall_clock=wall, listener=events.append, **kw)
    return router, clock, wall, events


def test_choice_skips_stale_and_not_admitting_nodes():
    nodes = [
        Node("a", "http://a", admitting=False, heartbeat=50_000.0),
        Node("b", "http://b", heartbeat=50_000.0 - 60),  # stale
        Node("c", "http://c", heartbeat=50_000.0 - 1),
    ]
    router, *_ = nodes_router(nodes, stale_after_s=15)
    assert {router.choose(f"s{i}").endpoint for i in range(50)} == {"http://c"}


def test_session_affinity_and_failover_within_a_request():
    nodes = [Node(n, f"http://{n}") for n in "abc"]
    router, *_ = nodes_router(nodes)
    home = router.choose("sess").endpoint
    assert all(router.choose("sess").endpoint == home for _ in range(10))
    other = router.choose("sess", failed=[home]).endpoint
    assert other != home
    # all failed: the home node again (it may only have been busy)
    assert router.choose("sess", failed=["http://a", "http://b", "http://c"]).endpoint == home


def test_alternatives_are_followed_first():
    router, *_ = nodes_router([Node("a", "http://a"), Node("n9", "http://n9:8080")])
    t = router.choose("s", failed=["http://a"], prefer=["n9:8080"])
    assert (t.endpoint, t.via) == ("http://n9:8080", "alternative")


def test_no_node_raises():
    router, *_ = nodes_router([Node("a", "http://a", admitting=False)])
    with pytest.raises(errors.NoNodeAvailable, match="0 fresh and admitting"):
        router.choose("s")


def test_breaker_transitions():
    b = CircuitBreaker("e", threshold=5, reset_after_s=10)
    for _ in range(4):
        assert not b.failure(0.0)
    assert b.success() is False and b.failures == 0  # a success resets the count
    opened = [b.failure(0.0) for _ in range(5)]
    assert opened == [False] * 4 + [True] and b.state is BreakerState.OPEN
    assert b.acquire(5.0) == (False, False)
    assert b.acquire(10.0) == (True, True) and b.state is BreakerState.HALF_OPEN
    assert b.acquire(10.0) == (False, False)  # one probe at a time
    b.failure(11.0)
    assert b.state is BreakerState.OPEN and b.acquire(12.0) == (False, False)
    assert b.acquire(21.0) == (True, True)
    assert b.success() is True and b.state is BreakerState.CLOSED


def test_open_circuit_sends_sessions_to_fallback_and_recovers():
    router, clock, _, events = nodes_router([Node("a", "http://a")], fallback="http://gateway", breaker_reset_s=10)
    target = router.choose("s")
    for _ in range(5):
        router.record(target, errors.InternalError("x"))
    assert events == [FallbackTriggered("http://a", "http://gateway", 5)]
    assert router.choose("s").endpoint == "http://gateway"
    router.record(router.choose("s"), None)
    clock.now += 10
    probe = router.choose("s")
    assert probe.endpoint == "http://a" and isinstance(events[-1], CircuitHalfOpen)
    assert router.choose("s2").endpoint == "http://gateway"  # probe in flight: others still use the fallback
    router.record(probe, None)
    assert isinstance(events[-1], CircuitClosed) and router.choose("s").endpoint == "http://a"


def test_open_circuit_without_fallback_uses_next_ring_node():
    router, *_ = nodes_router([Node("a", "http://a"), Node("b", "http://b")])
    home = router.choose("s")
    for _ in range(5):
        router.record(home, errors.APIConnectionError("refused", processed=False))
    assert router.choose("s").endpoint != home.endpoint


def test_refusals_do_not_count_against_a_node():
    router, *_ = nodes_router([Node("a", "http://a")])
    t = router.choose("s")
    for _ in range(10):
        router.record(t, errors.ResourceExhausted("busy"))
    assert router.breaker("http://a").state is BreakerState.CLOSED


def test_inference_node_status_parsing():
    status = {
        "endpoint": "10.0.0.7:8080",
        "lastHeartbeat": "2026-12-02T11:00:00Z",
        "gpus": [{"uuid": "GPU-1", "admitting": False}, {"uuid": "GPU-2", "admitting": True}],
    }
    node = node_from_status("gpu-node-1", status)
    assert node.endpoint == "http://10.0.0.7:8080" and node.admitting and node.heartbeat == 1796209200.0
    assert not node_from_status("x", {**status, "admitting": False}).admitting
    assert not node_from_status("x", {**status, "gpus": [{"admitting": False}]}).admitting
    assert node_from_status("x", {"gpus": []}) is None  # no endpoint yet
    doc = {"items": [{"metadata": {"name": "n1"}, "status": status}, {"metadata": {"name": "n2"}, "status": {}}]}
    assert [n.name for n in nodes_from_document(doc)] == ["n1"]
    assert [n.name for n in nodes_from_document({"nodes": [{"name": "n3", "endpoint": "h:1", "heartbeat": 5}]})] == ["n3"]


def test_static_map():
    m = StaticNodeMap(["h1:80", "http://h2:80/"])
    assert [n.endpoint for n in m.nodes()] == ["http://h1:80", "http://h2:80"]
    with pytest.raises(ValueError):
        StaticNodeMap([])


@pytest.mark.timeout(20)
def test_http_node_map_polls_a_real_endpoint(peers):
    from h2peer import Respond

    doc = {"nodes": [{"name": "n1", "endpoint": "127.0.0.1:1", "admitting": True, "gpus": [{"uuid": "GPU-0"}]}]}
    peer = peers(lambda req: Respond(200, doc))
    node_map = HttpNodeMap(peer.url + "/v1/gpu-map", interval_s=0.05)
    try:
        assert node_map.wait_ready(10)
        assert [n.endpoint for n in node_map.nodes()] == ["http://127.0.0.1:1"]
        assert peer.requests[0].path == "/v1/gpu-map" and peer.requests[0].method == "GET"
    finally:
        node_map.close()


def test_only_nodes_serving_the_model_are_chosen():
    nodes = [Node("a", "http://a", models=("big",)), Node("b", "http://b", models=("small", "big")),
             Node("c", "http://c")]  # c's source does not say: not ruled out
    router, *_ = nodes_router(nodes)
    assert {router.choose(f"s{i}", model="small").endpoint for i in range(60)} == {"http://b", "http://c"}
    assert {router.choose(f"s{i}", model="big").endpoint for i in range(60)} == {"http://a", "http://b", "http://c"}



def test_a_model_no_node_serves_goes_to_any_node_to_record_demand_and_nothing_usable_raises():
    """Issue 25: with no node serving the model (a fleet at zero) the SDK used to raise NoNodeAvailable
    at once; now any fresh, admitting node gets it, refuses it retryably and records the demand."""
    only = nodes_router([Node("a", "http://a", models=("big",))])[0]
    assert only.choose("s", model="small").endpoint == "http://a"
    shut = nodes_router([Node("a", "http://a", models=("big",), admitting=False)])[0]
    with pytest.raises(errors.NoNodeAvailable, match="serving small"):
        shut.choose("s", model="small")


def test_alternatives_not_serving_the_model_are_skipped():
    nodes = [Node("a", "http://a", models=("m",)), Node("b", "http://b", models=("other",))]
    router, *_ = nodes_router(nodes)
    target = router.choose("s", prefer=["http://b"], model="m")
    assert (target.endpoint, target.via) == ("http://a", "ring")


def test_models_come_from_the_status_or_the_spec():
    doc = {"items": [
        {"metadata": {"name": "n1"}, "spec": {"models": [{"name": "tiny", "source": {"path": "/m"}}]},
         "status": {"endpoint": "http://n1:8000"}},
        {"metadata": {"name": "n2"}, "spec": {"models": [{"name": "tiny"}]},
         "status": {"endpoint": "http://n2:8000", "models": ["big", "tiny-lora"]}},
        {"metadata": {"name": "n3"}, "status": {"endpoint": "http://n3:8000"}},
    ]}
    assert [n.models for n in nodes_from_document(doc)] == [("tiny",), ("big", "tiny-lora"), None]
    flat = nodes_from_document({"nodes": [{"name": "n4", "endpoint": "http://n4", "models": ["x"]}]})
    assert flat[0].models == ("x",)
