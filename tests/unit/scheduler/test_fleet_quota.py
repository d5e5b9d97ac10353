"""Fleet-wide quotas: the claim-enforcing scheduler wrapper, the pure claim planner, and the claim thread
against a TenantQuota store that behaves like the API server (resourceVersion preconditions, 409)."""

from __future__ import annotations

import copy
import threading

import pytest

from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.node.fleetquota import (ClaimConflict, FleetQuotaSettings, FleetQuotaSync, NodeClaim,
                                          claim_patch, node_claims, plan_claim, plan_dimension)
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig
from zerolayer.runtime.scheduler.api import TenantPolicy, Ticket
from zerolayer.runtime.scheduler.fleet import Claim, Demand, FleetQuotaScheduler

POLICY = TenantPolicy("acme", tokens_per_minute=1000, requests_per_minute=10)


def ticket(key: str, tokens: int = 100, tenant: str = "acme") -> Ticket:
    return Ticket(key, tenant, Priority.NORMAL, "m", prompt_tokens=0, max_tokens=tokens, deadline=None)


def fleet(**kw) -> FleetQuotaScheduler:
    inner = MicroScheduler(SchedulerConfig(), tenants={"acme": POLICY})
    f = FleetQuotaScheduler(inner, **kw)
    f.set_tenants({"acme": POLICY})
    return f


# ------------------------------------------------------------------ the wrapper
def test_no_claim_refuses_with_a_short_retry_and_records_the_demand():
    woken = []
    f = fleet(wake=lambda: woken.append(1), credit_requests=0)
    a = f.admit(ticket("s1", 100), 0.0)
    assert not a.admitted and a.code is ErrorCode.RATE_LIMITED and a.reason == "fleet_requests"
    assert a.headers["retry-after"] == "1" and woken
    [d] = f.demand(0.0)
    assert (d.used_tokens, d.refused_tokens, d.refused_requests, d.largest_request) == (0, 100, 1, 100)
    assert f.demand(0.0)[0].refused_tokens == 0  # reset by reading


def test_an_idle_node_admits_a_first_request_under_its_credit_and_claims_it():
    """Issue 25: a node's first request for a tenant (no claim held, as after 10 s idle) was a 429."""
    woken = []
    f = fleet(wake=lambda: woken.append(1))  # credit: 1 request, 5 % of 1000 tokens = 50
    first = f.admit(ticket("s1", 40), 0.0)
    assert first.admitted and woken  # the sync thread is woken to claim what the credit let in
    second = f.admit(ticket("s2", 5), 0.0)
    assert not second.admitted and second.reason == "fleet_requests"  # one request per window
    assert not fleet().admit(ticket("big", 60), 0.0).admitted  # beyond the credit's 50 tokens
    [d] = f.demand(0.0)
    assert (d.used_tokens, d.used_requests) == (40, 1)  # the planner claims it at its next round
    f.set_claim("acme", Claim(tokens=200, requests=5))
    assert f.admit(ticket("s3", 100), 1.0).admitted  # the claim, not the credit, now bounds it
    assert f.admit(ticket("s4", 80), 60.5).admitted and not f.admit(ticket("s5", 30), 60.5).admitted


def test_the_request_credit_is_a_share_of_the_limit_so_streams_sent_together_are_admitted():
    """CI: two streams sent together to an idle node, the second refused before the claim was written."""
    policy = TenantPolicy("acme", requests_per_minute=6000)
    inner = MicroScheduler(SchedulerConfig(), tenants={"acme": policy})
    f = FleetQuotaScheduler(inner)
    f.set_tenants({"acme": policy})
    assert f.credit(policy) == (0, 300)  # 5 % of 6000
    assert all(f.admit(ticket(f"s{i}", 10), 0.0).admitted for i in range(300))
    refused = f.admit(ticket("s300", 10), 0.0)
    assert not refused.admitted and refused.reason == "fleet_requests"  # the credit is bounded
    assert FleetQuotaScheduler(inner, credit_requests=0).credit(policy) == (0, 0)


def test_no_credit_when_the_claim_expired_or_the_fleet_is_fully_claimed():
    f = fleet()
    f.set_claim("acme", Claim(tokens=0, requests=0, valid_until=5.0))
    assert not f.admit(ticket("s1", 10), 6.0).admitted  # fail closed without the API server
    g = fleet()
    g.set_claim("acme", Claim(), room=False)
    assert not g.admit(ticket("s1", 10), 0.0).admitted


def test_admissions_stay_within_the_claim_and_settles_free_it():
    f = fleet()
    f.set_claim("acme", Claim(tokens=250, requests=10))
    first, second = f.admit(ticket("s1"), 0.0), f.admit(ticket("s2"), 0.0)
    assert first.admitted and second.admitted
    third = f.admit(ticket("s3"), 0.0)
    assert not third.admitted and third.reason == "fleet_tokens"
    f.settle(first.reservation, 20, 1.0)  # used 20 of the 100 reserved: 80 back
    assert f.admit(ticket("s4"), 1.0).admitted
    assert f.demand(1.0)[0].used_tokens == 220


def test_the_window_slides_and_a_refused_body_stage_releases_both_reservations():
    f = fleet()
    f.set_claim("acme", Claim(tokens=100, requests=10))
    assert f.admit(ticket("s1", 60), 0.0).admitted
    body = Ticket("s1", "acme", Priority.NORMAL, "m", prompt_tokens=50, max_tokens=60, deadline=None)
    refused = f.admit(body, 1.0, stage="body")
    assert not refused.admitted and refused.reason == "fleet_tokens"
    assert f.demand(1.0)[0].used_tokens == 0
    assert f.inner.open_streams() == 0  # the inner scheduler's HEADERS reservation went too
    assert f.admit(ticket("s2", 100), 1.0).admitted
    assert not f.admit(ticket("s3", 100), 30.0).admitted
    assert f.admit(ticket("s3", 100), 61.0).admitted  # s2's charge left the window


def test_an_expired_claim_admits_nothing_new():
    f = fleet()
    f.set_claim("acme", Claim(tokens=1000, requests=10, valid_until=5.0))
    assert f.admit(ticket("s1"), 4.0).admitted
    assert not f.admit(ticket("s2"), 5.0).admitted


def test_restored_usage_counts_until_it_leaves_the_window():
    f = fleet()
    f.restore("acme", 900, 9, 10.0)
    f.set_claim("acme", Claim(tokens=1000, requests=10))
    assert f.admit(ticket("s1", 100), 10.0).admitted
    assert not f.admit(ticket("s2", 100), 69.0).admitted
    assert f.admit(ticket("s2", 100), 70.5).admitted


def test_unlimited_tenants_and_too_large_requests_go_to_the_inner_scheduler():
    inner = MicroScheduler(SchedulerConfig(), tenants={"free": TenantPolicy("free"), "acme": POLICY})
    f = FleetQuotaScheduler(inner)
    f.set_tenants({"free": TenantPolicy("free"), "acme": POLICY})
    assert f.admit(ticket("s1", 100, tenant="free"), 0.0).admitted
    too_large = f.admit(ticket("s2", 5000), 0.0)
    assert not too_large.admitted and too_large.reason == "request_too_large"
    assert f.registry is inner.registry  # everything else is the inner scheduler's


# ------------------------------------------------------------------ the planner
@pytest.mark.parametrize("own,used,refused,others_claimed,others_want,expected", [
    (0, 0, 0, 0, 0, 0),            # idle, nothing held: nothing asked
    (0, 0, 100, 0, 0, 200),        # first refusal: demand + headroom, in quanta of 50
    (0, 0, 100, 950, 950, 50),     # only what the others leave free
    (240, 100, 0, 0, 0, 240),      # within hysteresis (one quantum): no write
    (800, 100, 0, 0, 0, 200),      # far above demand: give back down to demand + headroom
    (800, 0, 0, 200, 0, 0),        # idle here: everything back
    (500, 450, 200, 500, 1000, 450),  # fleet short: proportional share, never below what is used
    (700, 100, 0, 600, 0, 200),    # the limit was lowered under the claims: back within it at once
])
def test_plan_dimension(own, used, refused, others_claimed, others_want, expected):
    claim, _ = plan_dimension(1000, own, used, refused, 100, others_claimed, others_want, 0.10)
    assert claim == expected
    assert claim >= used
    assert claim + others_claimed <= 1000 or claim <= own and claim == used


def quota(nodes=None, rv="1", tpm=1000, rpm=100) -> dict:
    return {"metadata": {"name": "q-acme", "resourceVersion": rv, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"tenant": "acme", "tokensPerMinute": tpm, "requestsPerMinute": rpm},
            "status": {"fleetQuota": {"nodes": nodes or {}}}}


def entry(tokens, requests=0, want=0, at="2026-12-03T12:00:00Z", want_requests=0) -> dict:
    return {"tokens": tokens, "requests": requests, "wantTokens": want, "wantRequests": want_requests,
            "renewedAt": at}


def test_a_lapsed_lease_is_not_counted():
    now = 1796299200.0  # 2026-12-03T12:00:00Z
    q = quota({"n1": entry(900, at="2026-12-03T11:00:00Z"), "n2": entry(50)})
    demand = Demand("acme", 0, 0, 500, 1, 500)
    plan = plan_claim(q, "n3", demand, now, FleetQuotaSettings())
    assert plan.tokens == 950  # n1's hour-old claim is gone; n2's 50 stays
    assert claim_patch(q, "n3", plan, now)["metadata"] == {"resourceVersion": "1"}


# ------------------------------------------------------------------ the thread, against a fake API server
class Store:
    """One TenantQuota with API-server semantics for status merge patches with a resourceVersion."""

    def __init__(self, obj):
        self.obj = obj
        self.lock = threading.Lock()
        self.writes = 0

    def get(self, name):
        with self.lock:
            return copy.deepcopy(self.obj)

    def patch_status(self, name, patch):
        with self.lock:
            if patch["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
                raise ClaimConflict("409")
            nodes = self.obj["status"]["fleetQuota"]["nodes"]
            nodes.update(patch["status"]["fleetQuota"]["nodes"])
            self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
            self.writes += 1
            return copy.deepcopy(self.obj)


class Watch:
    def __init__(self, store):
        self.store = store
        self.started = threading.Event()
        self.started.set()

    @property
    def objects(self):
        return {"q-acme": self.store.get("q-acme")}


class Api:
    def __init__(self, store):
        self.store = store

    def watch(self, on_change, **_):
        return Watch(self.store)

    def get(self, name):
        return self.store.get(name)

    def patch_status(self, name, patch):
        return self.store.patch_status(name, patch)


class RacingApi(Api):
    """Another node writes between this node's read and its write, once."""

    def __init__(self, store):
        super().__init__(store)
        self.raced = False

    def patch_status(self, name, patch):
        if not self.raced:
            self.raced = True
            other = copy.deepcopy(self.store.obj)
            self.store.patch_status(name, claim_patch(other, "other", NodeClaim(700, 0, 700, 0), WALL))
        return super().patch_status(name, patch)


WALL = 1796299200.0


def node(api, name, clock):
    f = fleet()
    return f, FleetQuotaSync(api, f, name, wall=lambda: WALL + clock[0], clock=lambda: clock[0])


def test_claims_never_sum_above_the_limit_even_when_a_write_races():
    store = Store(quota())
    clock = [0.0]
    f, sync = node(RacingApi(store), "n1", clock)
    assert not f.admit(ticket("s1", 500), 0.0).admitted  # no claim yet: demand recorded
    sync.round()
    claims = node_claims(store.obj)
    assert sync.conflicts == 1 and claims["other"].tokens == 700
    assert claims["n1"].tokens == 300 and sum(c.tokens for c in claims.values()) <= 1000
    assert f.claim("acme").tokens == 300
    assert not f.admit(ticket("s2", 500), 0.0).admitted  # 500 > 300: this node's share, not the limit


@pytest.mark.parametrize("size,bound", [
    (100, 1000),           # larger than the credit (50 tokens): the limit exactly
    (40, 1000 + 3 * 50),   # within it: the limit plus one credit per node (the stated bound)
])
def test_three_nodes_share_the_limit_and_a_restart_keeps_the_window(size, bound):
    store = Store(quota())
    clock = [0.0]
    nodes = [node(Api(store), f"n{i}", clock) for i in range(3)]
    admitted = 0
    for step in range(40):  # every node wants far more than the limit
        clock[0] = step * 0.5
        for i, (f, sync) in enumerate(nodes):
            for k in range(3):
                a = f.admit(ticket(f"{i}-{step}-{k}", size), clock[0])
                admitted += size if a.admitted else 0
            sync.round()
            assert sum(c.tokens for c in node_claims(store.obj).values()) <= 1000
    assert admitted <= bound  # 20 s < one window: the fleet admitted at most the bound
    assert admitted >= 700  # and the limit was not stranded in idle claims
    # n0 restarts: a fresh scheduler restores its published claim as used.
    published = node_claims(store.obj)["n0"].tokens
    f, sync = node(Api(store), "n0", clock)
    sync.round()
    assert f.demand(clock[0])[0].used_tokens == published
    assert sum(c.tokens for c in node_claims(store.obj).values()) <= 1000


class StaleApi(Api):
    """The watch lags: it still shows the object before another node's write."""

    def __init__(self, store, stale):
        super().__init__(store)
        self.stale = stale

    def watch(self, on_change, **_):
        watch = Watch(self.store)
        type(watch).objects = property(lambda w: {"q-acme": copy.deepcopy(self.stale)})
        return watch


def test_a_stale_watch_never_raises_the_local_claim_without_a_conditional_write():
    at = "2026-12-03T12:00:00Z"
    mine = entry(200, 15, want=200, at=at, want_requests=15)  # exactly what this node's next plan will be
    stale = quota({"n1": mine}, rv="7")
    store = Store(quota({"n1": mine, "other": entry(900, 50, want=900, at=at)}, rv="8"))
    clock = [0.0]
    f, sync = node(StaleApi(store, stale), "n1", clock)
    sync._restored = True
    sync._written["acme"] = WALL  # written recently: no renewal due
    f.admit(ticket("s1", 100), 0.0)  # refused: no claim held here (say it was lowered locally), demand recorded
    sync.round()
    published = node_claims(store.obj)
    assert sync.conflicts == 1  # the write on the stale version was refused and planned again on a fresh read
    assert published["n1"].tokens + published["other"].tokens <= 1000
    assert f.claim("acme").tokens == published["n1"].tokens == 100
