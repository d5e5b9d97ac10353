"""Prefix-aware node choice: longest cached prefix within a load bound, and its place in the Router."""

from __future__ import annotations

import pytest

from zerolayer.client.nodes import Node, node_from_status
from zerolayer.client.prefixroute import Candidate, SentPrefixes, choose_by_prefix, load_bound
from zerolayer.client.routing import Router
from zerolayer.prefix import PrefixDigest, ServedPrefixes, chat_block_hashes, chat_turns

P = (11, 12, 13, 14)  # a prompt's chained block hashes
OTHER = (21, 22)


@pytest.mark.parametrize("loads, factor, bound", [
    ([0, 0, 0], 1.25, 1), ([3, 3, 3], 1.25, 5), ([9, 0, 0], 1.25, 5), ([4, 4], 1.0, 5), ([], 1.25, 2),
])
def test_load_bound(loads, factor, bound):
    assert load_bound(loads, factor) == bound
    assert load_bound(loads, factor, min_bound=4) == max(bound, 4)


def sent_with(**matches):
    sent = SentPrefixes()
    for node, blocks in matches.items():
        sent.add(node, blocks, now=0.0)
    return sent


# (candidates as (name, load, digest blocks or None), what this client sent where, expected first, reason, matched)
CASES = {
    "new prefix goes to its ring owner": (
        [("a", 0, None), ("b", 0, None), ("c", 0, None)], {}, "owner", "ring-owner", 0),
    "own history: longest match wins": (
        [("a", 0, None), ("b", 0, None), ("c", 0, None)], {"a": P[:1], "b": P[:3]}, "b", "longest-prefix", 3),
    "digest beats history when longer": (
        [("a", 0, P), ("b", 0, None), ("c", 0, None)], {"b": P[:2]}, "a", "longest-prefix", 4),
    "over the bound: the next best under it": (
        [("a", 6, P), ("b", 0, P[:2]), ("c", 0, None)], {}, "b", "longest-prefix", 2),
    "a busy node with the prefix within the bound keeps it": (
        [("a", 3, P), ("b", 2, None), ("c", 2, None)], {}, "a", "longest-prefix", 4),
    "another prompt's blocks do not match": (
        [("a", 0, OTHER), ("b", 0, None), ("c", 0, None)], {"b": OTHER}, "owner", "ring-owner", 0),
}


@pytest.mark.parametrize("name", CASES)
def test_choose_by_prefix(name):
    nodes, sent, first, reason, matched = CASES[name]
    candidates = [Candidate(n, load, PrefixDigest.of(d) if d is not None else None) for n, load, d in nodes]
    choice = choose_by_prefix(candidates, P, sent_with(**sent), now=100.0)
    owner = choose_by_prefix([Candidate(n) for n, _, _ in nodes], P, SentPrefixes(), now=100.0).order[0]
    assert choice.order[0] == (owner if first == "owner" else first)
    assert (choice.reason, choice.matched_blocks) == (reason, matched)
    assert sorted(choice.order) == sorted(c.name for c in candidates)


@pytest.mark.parametrize("loads, expected", [
    ((0, 0, 0), 0),  # CHWBL bound ceil(1.25 * 1 / 3) = 1: the idle owner
    ((1, 0, 0), 1),  # bound 1: the owner is over it, the next in ring order is not
    ((2, 0, 0), 1),  # bound 2: same
    ((1, 1, 1), 0),  # bound 2: the owner fits
    ((2, 2, 0), 0),  # bound 3: the owner fits, although the third node is idle
])
@pytest.mark.parametrize("digests", [False, True])
def test_without_a_match_chwbl_walks_the_ring(loads, expected, digests):
    ring = choose_by_prefix([Candidate(n) for n in "abc"], P, SentPrefixes(), now=0.0).order
    candidates = [Candidate(name, load, PrefixDigest.of([99]) if digests else None) for name, load in zip(ring, loads)]
    choice = choose_by_prefix(candidates, P, SentPrefixes(), now=0.0)
    assert choice.order[0] == ring[expected]
    assert choice.reason == ("ring-owner" if expected == 0 else "ring-next")


def test_a_digest_makes_old_history_untrusted():
    sent = SentPrefixes()
    sent.add("b", P, now=0.0)  # long ago: b has since published a digest without P (it reset its cache)
    candidates = [Candidate("a", 0, PrefixDigest.of(P[:1])), Candidate("b", 0, PrefixDigest())]
    assert choose_by_prefix(candidates, P, sent, now=100.0).order[0] == "a"
    sent.add("b", P, now=99.0)  # but a send newer than the digest counts
    assert choose_by_prefix(candidates, P, sent, now=100.0).order[0] == "b"


def test_an_empty_prompt_prefix_is_refused():
    with pytest.raises(ValueError):
        choose_by_prefix([Candidate("a")], (), SentPrefixes(), now=0.0)


class Map:
    def __init__(self, nodes):
        self.items = list(nodes)

    def nodes(self):
        return self.items

    def close(self):
        pass


def router(policy="prefix", n=3, **node_kw):
    nodes = [Node(f"n{i}", f"http://10.0.0.{i}:8080", **node_kw) for i in range(n)]
    return Router(Map(nodes), policy=policy, clock=lambda: 1000.0, wall_clock=lambda: 50_000.0)


SYSTEM = "You answer questions about one tenant's invoices, politely and briefly. " * 30


def prompt(system: str, question: str) -> tuple[int, ...]:
    return chat_block_hashes(chat_turns({"system": system, "messages": [{"role": "user", "content": question}]}))


def test_router_keeps_a_shared_prefix_on_one_node_whatever_the_session():
    r = router()
    targets = set()
    for i in range(20):  # the case: 20 requests, one system prompt, a session each, sequential
        target = r.choose(f"session-{i}", prefix=prompt(SYSTEM, f"question {i}?"))
        targets.add(target.endpoint)
        r.record(target, None)
    assert len(targets) == 1


def test_router_spreads_a_hot_prefix_when_its_node_is_over_the_bound():
    r = router()
    blocks = prompt(SYSTEM, "q")
    targets = [r.choose(f"s{i}", prefix=blocks) for i in range(9)]  # none completes: load builds up
    per_node = {t.endpoint: sum(x.endpoint == t.endpoint for x in targets) for t in targets}
    assert len(per_node) == 3 and max(per_node.values()) <= 4  # bound ceil(1.25 * 9 / 3) = 4
    assert r.in_flight(targets[0].endpoint) == per_node[targets[0].endpoint]
    for t in targets:
        r.record(t, None)
    assert all(r.in_flight(t.endpoint) == 0 for t in targets)


def test_router_without_a_full_block_keeps_session_affinity():
    r, s = router(), router(policy="session")
    for i in range(30):
        assert r.choose(f"s{i}", prefix=prompt("short", "q")).endpoint == s.choose(f"s{i}").endpoint


def test_round_robin_rotates():
    r = router(policy="round_robin")
    assert len({r.choose("same").endpoint for _ in range(3)}) == 3


def test_router_routes_by_a_gossiped_digest():
    record = ServedPrefixes()
    record.observe(prompt(SYSTEM, "anything"))
    nodes = [node_from_status(f"n{i}", {"endpoint": f"10.0.0.{i}:8080", "load": {"running": 0, "waiting": 0},
                                        **({"prefixCache": record.status()} if i == 2 else {})}) for i in range(3)]
    assert nodes[2].prefix_digest is not None and nodes[0].prefix_digest is None and nodes[0].load == 0
    r = Router(Map(nodes), clock=lambda: 1000.0, wall_clock=lambda: 50_000.0)
    assert r.choose("s", prefix=prompt(SYSTEM, "a new question")).node == "n2"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        router(policy="random")
