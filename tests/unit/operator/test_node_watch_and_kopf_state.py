"""Nodes without a watch of every Node (Reconciler, "Nodes"; Kube.watch_stream for one missing Node),
kopf's bookkeeping kept in memory (operator/kopfstate.py), and the coalesced DaemonSet triggers."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from zerolayer.operator import kube
from zerolayer.operator.errors import KubeError
from zerolayer.operator.kopfstate import KopfState
from zerolayer.operator.reconcile import INODE, Reconciler, WaitingFor

from tests.unit.operator.fakes import FakeKube
from tests.unit.operator.test_reconcile import CONFIG, world


def node(name, rv, **labels):
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": rv, "labels": labels}}


class ScriptedKube(kube.Kube):
    """Kube whose LISTs and watch requests answer from scripts (no HTTP)."""

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)
        self.watch_versions: list[str | None] = []
        self._on_request = lambda *a: None

    async def request(self, method, path, **_):
        assert method == "GET" and path == "/api/v1/nodes"
        return self.lists.pop(0)

    async def watch_once(self, path, plural, version, timeout_seconds, selector=None):
        self.watch_versions.append(version)
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event


async def take(stream, n):
    out = []
    async for item in stream:
        out.append(item)
        if len(out) == n:
            break
    await stream.aclose()
    return out


async def test_watch_stream_lists_then_resumes_and_relists_only_after_gone():
    k = ScriptedKube(
        lists=[{"metadata": {"resourceVersion": "10"}, "items": [node("a", "5", x="1"), node("b", "6")]},
               {"metadata": {"resourceVersion": "30"}, "items": [node("a", "25")]}],
        watches=[[("MODIFIED", node("a", "11")), ("BOOKMARK", {"metadata": {"resourceVersion": "15"}})],
                 [("ERROR", {"code": 410, "message": "too old"})],
                 [("ADDED", node("c", "31"))]])
    events = await take(k.watch_stream("v1", "Node", retry_seconds=0.0), 6)
    assert [(t, o["metadata"]["name"]) for t, o in events] == [
        ("ADDED", "a"), ("ADDED", "b"),  # the first LIST
        ("MODIFIED", "a"),  # the watch; its bookmark advanced the version without an event
        ("DELETED", "b"), ("ADDED", "a"),  # after 410 Gone: a LIST, and b vanished meanwhile
        ("ADDED", "c")]
    assert events[0][1]["kind"] == "Node" and events[0][1]["apiVersion"] == "v1"  # list items lack them
    assert k.watch_versions == ["10", "15", "30"]  # resumed at the bookmark, not listed again


async def test_watch_stream_retries_an_error_without_listing_again():
    k = ScriptedKube(lists=[{"metadata": {"resourceVersion": "10"}, "items": []}],
                     watches=[KubeError("no answer", status=0), [("ADDED", node("a", "11"))]])
    events = await take(k.watch_stream("v1", "Node", retry_seconds=0.0), 1)
    assert [t for t, _ in events] == ["ADDED"] and k.watch_versions == ["10", "10"] and k.lists == []


async def test_a_node_is_read_from_the_api_server_when_its_runtime_is_scheduled_nowhere():
    """No watch follows Nodes: the DaemonSet controller's status says whether the Node still
    exists with its label; a remembered copy of the Node is used unless it says no."""
    from tests.unit.operator.test_reconcile import mark_runtime_ready, snapshot

    kube_, rec, inode = world()
    await rec.reconcile_inference_node(inode)  # no DaemonSet yet: a copy if one is left (Kube: a miss reads)
    assert ("Node", "gpu-node-0", True) in kube_.reads
    ds = kube_.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    ds["status"] = {"observedGeneration": 0, "desiredNumberScheduled": 0}  # not yet seen by its controller
    kube_.reads.clear()
    await rec.reconcile_inference_node(snapshot(kube_))
    assert [r for r in kube_.reads if r[0] == "Node"] == [("Node", "gpu-node-0", True)]
    mark_runtime_ready(kube_)
    kube_.reads.clear()
    await rec.reconcile_inference_node(snapshot(kube_))
    assert [r for r in kube_.reads if r[0] == "Node"] == [("Node", "gpu-node-0", True)]
    ds = kube_.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    ds["status"]["desiredNumberScheduled"] = 0  # the Node lost its label or went away
    del kube_.find("v1", "Node", "gpu-node-0")["metadata"]["labels"]["zerolayer.io/inference-node"]
    kube_.reads.clear()
    await rec.reconcile_inference_node(snapshot(kube_))
    assert [r for r in kube_.reads if r[0] == "Node"] == [("Node", "gpu-node-0", False)]
    assert kube_.find("v1", "Node", "gpu-node-0")["metadata"]["labels"]["zerolayer.io/inference-node"] == "true"


async def test_a_missing_node_is_watched_by_name_until_it_appears():
    kube_, rec, inode = world(with_node=False)
    appeared = asyncio.Event()
    selectors, repaired = [], []

    async def stream(api_version, kind, *, field_selector=None):
        selectors.append(field_selector)
        await appeared.wait()
        yield "ADDED", node("gpu-node-0", "3")
        await asyncio.Event().wait()  # the watch would stay open: the waiter must close it

    kube_.watch_stream = stream
    rec.reconcile_soon = lambda kind, name, delay: repaired.append((kind, name, delay))
    for _ in range(2):  # the first reconcile and a retry: one watch
        with pytest.raises(WaitingFor):
            await rec.reconcile_inference_node(inode)
    await asyncio.sleep(0.01)
    assert selectors == ["metadata.name=gpu-node-0"] and list(rec.nodes.watches) == ["gpu-node-0"]
    appeared.set()
    await asyncio.sleep(0.01)
    assert repaired == [(INODE, "gpu-node-0", 0.0)]
    assert rec.nodes.watches == {}
    await rec.close()


async def test_deleting_the_waiting_inference_node_closes_its_node_watch():
    kube_, rec, inode = world(with_node=False)
    closed = asyncio.Event()

    async def stream(api_version, kind, *, field_selector=None):
        try:
            await asyncio.Event().wait()
            yield "ADDED", {}
        finally:
            closed.set()

    kube_.watch_stream = stream
    with pytest.raises(WaitingFor):
        await rec.reconcile_inference_node(inode)
    await asyncio.sleep(0.01)
    await rec.delete_inference_node(kube_.find("zerolayer.io/v1alpha1", "InferenceNode", "gpu-node-0"))
    await asyncio.wait_for(closed.wait(), 1)
    assert rec.nodes.watches == {} and "gpu-node-0" not in rec.nodes.missing


def test_kopf_bookkeeping_stays_in_memory_and_only_a_retry_touch_writes():
    state = KopfState()
    body = kopf.Body({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
                      "metadata": {"name": "t", "uid": "u1"}, "spec": {"tenant": "t"}})
    patch = kopf.Patch()
    essence = state.diffbase.build(body=body)
    state.diffbase.store(body=body, patch=patch, essence=essence)
    state.progress.store(key="h", record={"retries": 1, "delayed": "x"}, body=body, patch=patch)
    assert not patch  # nothing goes onto the object
    assert state.diffbase.fetch(body=body) == essence
    assert state.progress.fetch(key="h", body=body) == {"retries": 1, "delayed": "x"}
    state.progress.purge(key="h", body=body, patch=patch)
    assert state.progress.fetch(key="h", body=body) is None and not patch
    state.progress.touch(body=body, patch=patch, value="2026-01-01T00:00:00")  # wakes a delayed retry
    assert patch["metadata"]["annotations"]["zerolayer.io/touch-dummy"] == "2026-01-01T00:00:00"
    state.forget_if_deleted({"type": "MODIFIED", "object": dict(body)})
    assert len(state.diffbase) == 1
    state.forget_if_deleted({"type": "DELETED", "object": dict(body)})
    assert len(state.diffbase) == 0 and state.diffbase.fetch(body=body) is None


async def test_a_runtime_coming_up_is_reconciled_late_unless_it_becomes_ready_first(monkeypatch):
    """DaemonSet status bursts: intermediate rollout states wait ROLLOUT_SETTLE_SECONDS (one status
    write fewer per state), a ready (or unschedulable) runtime is reconciled within COALESCE_SECONDS."""
    from zerolayer.operator import reconcile

    monkeypatch.setattr(reconcile, "ROLLOUT_SETTLE_SECONDS", 0.3)
    monkeypatch.setattr(reconcile, "COALESCE_SECONDS", 0.02)
    rec = Reconciler(FakeKube(), CONFIG)
    calls = []

    async def by_name(name):
        calls.append(name)
    rec.reconcile_inference_node_by_name = by_name
    ds = {"metadata": {"generation": 1},
          "status": {"observedGeneration": 1, "desiredNumberScheduled": 1, "updatedNumberScheduled": 1}}
    rec.daemonset_changed("a", ds)  # pod not ready yet
    rec.daemonset_changed("b", ds)
    await asyncio.sleep(0.1)
    assert calls == []  # still settling
    rec.daemonset_changed("a", {**ds, "status": {**ds["status"], "numberReady": 1}})  # ready: sooner
    await asyncio.sleep(0.1)
    assert calls == ["a"]
    await asyncio.sleep(0.3)
    assert calls == ["a", "b"]  # the other one once its settle time passed, exactly once
    assert rec.soon.pending == {}
    await rec.close()


async def test_a_later_request_joins_the_pending_reconcile():
    rec = Reconciler(FakeKube(), CONFIG)
    rec.reconcile_soon(INODE, "a", delay=5)
    first = rec.soon.pending[(INODE, "a")][0]
    rec.reconcile_soon(INODE, "a", delay=10)  # later: joins
    assert rec.soon.pending[(INODE, "a")][0] is first
    rec.reconcile_soon(INODE, "a", delay=1)  # sooner: replaces it
    assert rec.soon.pending[(INODE, "a")][0] is not first
    await asyncio.sleep(0)
    assert first.cancelled() and len(rec.soon.pending) == 1
    await rec.close()
    assert rec.soon.pending == {}


def test_freshest_prefers_the_cache_only_when_it_is_newer():
    from tests.unit.operator.test_kube_and_layers import CountingKube

    k = CountingKube({})
    k.watch("zerolayer.io/v1alpha1", "InferenceNode", None)
    old = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
           "metadata": {"name": "x", "resourceVersion": "5"}, "status": {}}
    new = {**old, "metadata": {**old["metadata"], "resourceVersion": "7"}, "status": {"phase": "Ready"}}
    assert k.freshest(old) is old  # nothing cached
    k.observe("MODIFIED", new)
    assert k.freshest(old)["status"] == {"phase": "Ready"}  # our own write overtook the event's body
    newer = {**old, "metadata": {**old["metadata"], "resourceVersion": "9"}}
    assert k.freshest(newer) is newer


async def test_a_remembered_kind_is_served_from_our_own_reads_only_when_asked():
    from tests.unit.operator.test_kube_and_layers import CountingKube

    k = CountingKube({"/api/v1/nodes/n": node("n", "5")})
    k.remember("v1", "Node")
    await k.get("v1", "Node", "n", cached=True)
    await k.get("v1", "Node", "n", cached=True)
    assert len(k.calls) == 1  # the second from our own read
    await k.get("v1", "Node", "n")
    assert len(k.calls) == 2  # not asked for a cached copy: a real read


def test_each_selector_has_its_own_finalizer_and_the_default_keeps_the_old_name():
    from zerolayer.operator.handlers import FINALIZER, finalizer_for

    assert finalizer_for(None) == finalizer_for({}) == FINALIZER == "zerolayer.io/finalizer"
    a, b = finalizer_for({"team": "a"}), finalizer_for({"team": "b"})
    assert a != b and a.startswith(FINALIZER + "-") and len(a.split("/")[1]) <= 63
    assert finalizer_for({"x": "1", "y": "2"}) == finalizer_for({"y": "2", "x": "1"})  # order does not matter
