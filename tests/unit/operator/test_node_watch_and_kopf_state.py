"""The operator's own Node watch (Kube.watch_stream, Reconciler.node_changed/follow_nodes) and kopf's
bookkeeping kept in memory (operator/kopfstate.py): what each does and what each never writes."""

from __future__ import annotations

import asyncio

import kopf

from zerolayer.operator import kube
from zerolayer.operator.errors import KubeError
from zerolayer.operator.kopfstate import KopfState
from zerolayer.operator.reconcile import INODE, Reconciler

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

    async def _watch_once(self, path, plural, version, timeout_seconds):
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


def test_only_claimed_nodes_that_appear_vanish_or_lose_the_label_ask_for_repair():
    rec = Reconciler(FakeKube(), CONFIG)
    rec.node_index["n1"].add("inode-1")
    labelled = node("n1", "2", **{"zerolayer.io/inference-node": "true"})
    assert rec.node_changed("MODIFIED", labelled) == []  # a status heartbeat
    assert rec.node_changed("MODIFIED", node("other", "3")) == []  # nobody's node
    assert rec.node_changed("MODIFIED", node("n1", "4")) == ["inode-1"]  # label removed
    assert rec.node_changed("DELETED", labelled) == ["inode-1"]
    assert rec.node_changed("ADDED", labelled) == []  # a relist of a node nobody waits for
    rec.missing_nodes.add("n1")
    assert rec.node_changed("ADDED", labelled) == ["inode-1"]


async def test_follow_nodes_feeds_the_cache_and_repairs_the_claiming_inference_node():
    kube_, rec, inode = world()
    await rec.reconcile_inference_node(inode)  # labels gpu-node-0 and claims it
    seen, repaired = [], []

    async def stream(api_version, kind):
        yield "MODIFIED", node("gpu-node-0", "7", **{"zerolayer.io/inference-node": "true"})
        yield "MODIFIED", node("gpu-node-0", "8")  # someone removed the label
        await asyncio.Event().wait()  # a watch stays open

    kube_.watch_stream = stream
    kube_.observe = lambda t, o: seen.append((t, o["metadata"]["resourceVersion"]))
    rec.reconcile_soon = lambda kind, name, delay: repaired.append((kind, name, delay))
    task = asyncio.create_task(rec.follow_nodes())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert seen == [("MODIFIED", "7"), ("MODIFIED", "8")]
    assert repaired == [(INODE, "gpu-node-0", 0.0)]


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
