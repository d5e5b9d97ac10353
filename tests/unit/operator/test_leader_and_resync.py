"""Leader election over a Lease (operator/leader.py) and the one rare full resync (Reconciler)."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest

from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import ConfigError, Conflict, KubeError, NotFound
from zerolayer.operator.leader import LeaderElector
from zerolayer.operator.reconcile import Reconciler

from tests.unit.operator.fakes import FakeKube

PATH = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/zl"


class LeaseServer:
    """The API server's rules for one Lease: create once, update only at the current resourceVersion."""

    def __init__(self):
        self.lease: dict | None = None
        self.version = 0
        self.down = False
        self.calls: list[str] = []

    def client(self):
        server = self

        class Client:
            async def request(self, method, path, *, body=None, **_):
                server.calls.append(method)
                if server.down:
                    raise KubeError("no answer", status=0)
                if method == "GET":
                    if server.lease is None:
                        raise NotFound("none", status=404)
                    return copy.deepcopy(server.lease)
                if method == "POST":
                    if server.lease is not None:
                        raise Conflict("exists", status=409)
                    server.version += 1
                    server.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(server.version)}}
                    return copy.deepcopy(server.lease)
                if method == "PUT":
                    assert path == PATH
                    if body["metadata"]["resourceVersion"] != server.lease["metadata"]["resourceVersion"]:
                        raise Conflict("stale", status=409)
                    server.version += 1
                    server.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(server.version)}}
                    return copy.deepcopy(server.lease)
                raise AssertionError(method)
        return Client()

    @property
    def holder(self):
        return ((self.lease or {}).get("spec") or {}).get("holderIdentity")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def elector(server, identity, clock, duration=30.0):
    return LeaderElector(server.client(), "ops", "zl", identity, duration, clock=clock)


async def test_first_candidate_takes_the_free_lease_and_the_second_stands_by():
    server, clock = LeaseServer(), Clock()
    a, b = elector(server, "a", clock), elector(server, "b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    assert server.holder == "a"
    assert server.lease["spec"]["leaseDurationSeconds"] == 30


async def test_a_renewing_holder_keeps_the_lease_however_long_the_standby_waits():
    server, clock = LeaseServer(), Clock()
    a, b = elector(server, "a", clock), elector(server, "b", clock)
    await a.try_acquire_or_renew()
    for _ in range(10):
        clock.t += 10  # the holder renews every duration/3
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    assert server.holder == "a" and b.transitions == 0


async def test_a_renewal_is_one_update_and_a_changed_lease_is_read_first():
    server, clock = LeaseServer(), Clock()
    a = elector(server, "a", clock)
    await a.try_acquire_or_renew()
    server.calls.clear()
    assert await a.try_acquire_or_renew()
    assert server.calls == ["PUT"]  # idle cost: one request per renewal
    server.lease["spec"]["holderIdentity"] = "b"  # someone else took it (a new resourceVersion)
    server.version += 1
    server.lease["metadata"]["resourceVersion"] = str(server.version)
    server.calls.clear()
    assert not await a.try_acquire_or_renew()
    assert server.calls == ["PUT", "GET"] and server.holder == "b"


async def test_a_dead_holder_is_replaced_only_after_a_full_duration_on_the_standbys_clock():
    server, clock = LeaseServer(), Clock()
    a, b = elector(server, "a", clock), elector(server, "b", clock)
    await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b first sees a's record now
    clock.t += 29
    assert not await b.try_acquire_or_renew()
    # a stopped acting at its renew deadline (20 s), well before b may take over (30 s)
    assert not a.holding()
    clock.t += 2
    assert await b.try_acquire_or_renew()
    assert server.holder == "b" and server.lease["spec"]["leaseTransitions"] == 1


async def test_of_two_standbys_racing_for_an_expired_lease_one_wins():
    server, clock = LeaseServer(), Clock()
    dead = elector(server, "dead", clock)
    await dead.try_acquire_or_renew()
    b, c = elector(server, "b", clock), elector(server, "c", clock)
    await b.try_acquire_or_renew()
    await c.try_acquire_or_renew()
    clock.t += 31
    # both read the same expired record; the first update wins, the second is refused (409)
    lease_b = await b.kube.request("GET", PATH)
    won = await c.try_acquire_or_renew()
    server_lease = copy.deepcopy(server.lease)
    with pytest.raises(Conflict):
        await b.kube.request("PUT", PATH, body={**lease_b, "spec": {**lease_b["spec"], "holderIdentity": "b"}})
    assert won and server_lease["spec"]["holderIdentity"] == "c" and server.holder == "c"
    assert not await b.try_acquire_or_renew()


async def test_hold_returns_when_another_takes_the_lease_or_renewals_fail():
    server, clock = LeaseServer(), Clock()
    a = LeaderElector(server.client(), "ops", "zl", "a", 30.0, clock=clock, sleep=lambda s: _advance(clock, s))
    await a.try_acquire_or_renew()
    server.lease["spec"]["holderIdentity"] = "usurper"  # e.g. an admin hands it over
    server.version += 1
    server.lease["metadata"]["resourceVersion"] = str(server.version)
    await asyncio.wait_for(a.hold(), 1)
    assert not a.holding()

    server2, clock2 = LeaseServer(), Clock()
    b = LeaderElector(server2.client(), "ops", "zl", "b", 30.0, clock=clock2, sleep=lambda s: _advance(clock2, s))
    await b.try_acquire_or_renew()
    server2.down = True  # API server unreachable: stop at the renew deadline (20 s), not later
    await asyncio.wait_for(b.hold(), 1)
    assert clock2.t - 1000.0 <= 30.0 and not b.holding()


async def _advance(clock, seconds):
    clock.t += seconds


async def test_release_frees_the_lease_for_the_standby_at_once():
    server, clock = LeaseServer(), Clock()
    a, b = elector(server, "a", clock), elector(server, "b", clock)
    await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert server.holder is None
    assert await b.try_acquire_or_renew()  # no wait for the duration


async def test_acquire_waits_then_takes_over():
    server, clock = LeaseServer(), Clock()
    await elector(server, "dead", clock).try_acquire_or_renew()
    sleeps = []

    async def sleep(s):
        sleeps.append(s)
        clock.t += s
    b = LeaderElector(server.client(), "ops", "zl", "b", 30.0, clock=clock, sleep=sleep)
    await asyncio.wait_for(b.acquire(), 1)
    assert server.holder == "b" and sleeps == [10.0] * 3  # polls every duration/3 until 30 s passed


# ----------------------------------------------------------------- config and the full resync
def test_resync_and_lease_settings_come_from_the_chart_environment():
    cfg = OperatorConfig.from_env({"ZEROLAYER_RESYNC_SECONDS": "7200", "ZEROLAYER_LEADER_ELECTION": "false",
                                   "ZEROLAYER_LEASE_SECONDS": "15", "ZEROLAYER_RETRY_SECONDS": "5",
                                   "ZEROLAYER_LEASE_NAME": "my-lease"})
    assert (cfg.resync_seconds, cfg.leader_election, cfg.lease_seconds, cfg.retry_seconds, cfg.lease_name) == \
        (7200.0, False, 15.0, 5.0, "my-lease")
    assert OperatorConfig().resync_seconds >= 3600  # hours by default: watches repair drift
    with pytest.raises(ConfigError):
        OperatorConfig.from_env({"ZEROLAYER_LEADER_ELECTION": "maybe"})
    with pytest.raises(ConfigError):
        OperatorConfig(lease_seconds=1)


async def test_resync_forever_waits_the_configured_period_with_bounded_jitter():
    cfg = OperatorConfig(runtime_namespace="zl-run", resync_seconds=7200, resync_jitter=0.2)
    rec = Reconciler(FakeKube(), cfg)
    waits, runs = [], []

    async def resync_all():
        runs.append(1)
    rec.resync_all = resync_all

    async def sleep(s):
        waits.append(s)
        if len(waits) == 50:
            raise asyncio.CancelledError
    with pytest.raises(asyncio.CancelledError):
        await rec.resync_forever(sleep=sleep, rng=random.Random(1))
    assert len(runs) == 49
    assert all(7200 <= w <= 7200 * 1.2 for w in waits) and len(set(waits)) == 50  # jittered, within bounds


async def test_resync_all_reconciles_every_selected_object_and_rereads_the_cache():
    from tests.unit.operator.test_reconcile import CONFIG, world

    kube, _, inode = world()
    inode["metadata"].update(labels={"run": "x"}, finalizers=["f"])
    kube.put(inode)
    kube.put({**inode, "metadata": {"name": "other", "labels": {"run": "y"}, "finalizers": ["f"]}})
    forgotten = []
    kube.forget = lambda: forgotten.append(1)
    kube.list_calls = []
    rec = Reconciler(kube, CONFIG, selector={"run": "x"})
    counts = await rec.resync_all()
    assert forgotten == [1]
    assert counts == {"progressing": 1}  # only the selected one, reconciled: its children exist
    assert kube.kinds("DaemonSet") == ["zl-runtime-gpu-node-0"]


async def test_tenants_reconciled_together_publish_their_key_hashes_in_one_write():
    from tests.unit.operator.test_reconcile import CONFIG

    kube = FakeKube()
    bodies = []
    for i in range(20):
        kube.secrets[("zl-run", f"t{i}-keys")] = {"api-keys": f"key-{i}\n"}
        bodies.append(kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
                                "metadata": {"name": f"t{i}", "generation": 1},
                                "spec": {"tenant": f"t{i}", "apiKeySecretRef": {"name": f"t{i}-keys"},
                                         "namespaces": [f"team-{i}"], "tokensPerMinute": 1, "requestsPerMinute": 1}}))
    rec = Reconciler(kube, CONFIG)
    outcomes = await asyncio.gather(*(rec.reconcile_tenant_quota(b) for b in bodies))
    assert all(o.ready for o in outcomes)
    assert [w for w in kube.writes if w[0] == "publish"] == [("publish", "v1", "Secret", "zl-run", "zl-tenant-keys")]
    assert sorted(kube.published_tenant_keys("zl-run")) == sorted(f"t{i}" for i in range(20))


async def test_a_burst_of_triggers_is_one_reconcile_from_the_newest_state():
    from tests.unit.operator.test_reconcile import CONFIG, mark_runtime_ready, world
    from zerolayer.operator.reconcile import INODE

    kube, _, inode = world()
    inode["metadata"]["finalizers"] = ["f"]
    kube.put(inode)
    rec = Reconciler(kube, CONFIG)
    await rec.reconcile_inference_node(inode)
    calls = []
    original = rec.reconcile_inference_node

    async def counting(body):
        calls.append(body["metadata"]["name"])
        return await original(body)
    rec.reconcile_inference_node = counting
    for _ in range(5):
        rec.reconcile_soon(INODE, "gpu-node-0", delay=0.01)
    mark_runtime_ready(kube)  # the newest state, reached before the reconcile runs
    await asyncio.sleep(0.1)
    assert calls == ["gpu-node-0"]
    status = kube.find("zerolayer.io/v1alpha1", "InferenceNode", "gpu-node-0")["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["RuntimeReady"] == "True"
    rec.reconcile_soon(INODE, "gpu-node-0", delay=10)
    await rec.close()  # the operator's cleanup: nothing left running
    assert rec.soon.pending == {}
