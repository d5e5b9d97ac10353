"""The thin InferenceFleet reconciler (operator/zerolayer/operator/fleet.py): what it reads and writes
around the pure planner, against a fake of the kube layer (no cluster)."""

from __future__ import annotations

import datetime

import pytest

from zerolayer.operator.errors import SpecError
from zerolayer.operator.fleet import FleetReconciler
from zerolayer.operator.fleet_plan import build_inference_node

NOW = datetime.datetime(2026, 12, 4, 12, 0, 0, tzinfo=datetime.timezone.utc)


class FakeKube:
    def __init__(self, inodes=(), nodes=()):
        self.cache = list(inodes)
        self.server_inodes = list(inodes)
        self.nodes = list(nodes)
        self.calls: list[tuple] = []

    def freshest(self, body):
        return body

    def seen_all(self, api_version, kind):
        return list(self.cache)

    async def list(self, api_version, kind, namespace=None, *, label_selector=None):
        self.calls.append(("list", kind, label_selector))
        return list(self.server_inodes if kind == "InferenceNode" else self.nodes)

    async def request(self, method, path, *, body=None, content_type="", query=None):
        self.calls.append((method, path, body))
        return {}

    async def ensure(self, desired):
        self.calls.append(("ensure", desired["metadata"]["name"]))
        return "created", desired

    async def delete(self, api_version, kind, name, namespace=None):
        self.calls.append(("delete", name))
        return True

    async def patch_status(self, api_version, kind, name, status, namespace=None):
        self.calls.append(("status", name, status))

    async def event(self, involved, reason, message, *, warning=False):
        self.calls.append(("event", reason))


def fleet(replicas=1, **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": "f", "uid": "u", "generation": 1},
            "spec": {"replicas": replicas, "nodeSelector": {"gpu": "yes"},
                     "models": [{"name": "m", "source": {"path": "/m"}}], **spec}}


def node(name):
    return {"metadata": {"name": name, "labels": {"gpu": "yes"}}}


async def test_placing_reads_inference_nodes_and_selected_nodes_fresh_then_creates():
    kube = FakeKube(nodes=[node("a"), node("b")])
    plan = await FleetReconciler(kube, now=lambda: NOW).reconcile(fleet(1))
    kinds = [c[0] for c in kube.calls]
    assert kinds[:3] == ["list", "list", "ensure"]
    assert kube.calls[1] == ("list", "Node", "gpu=yes") and kube.calls[2] == ("ensure", "f-a")
    assert plan.phase == "Progressing" and ("event", "Placing") in kube.calls


async def test_a_steady_fleet_costs_no_request_once_its_status_is_written():
    f = fleet(1)
    child = build_inference_node(f, "a")
    child["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    kube = FakeKube(inodes=[child])
    reconciler = FleetReconciler(kube, now=lambda: NOW)
    await reconciler.reconcile(f)
    [(_, _, status)] = [c for c in kube.calls if c[0] == "status"]
    assert status["phase"] == "Ready" and status["replicas"] == 1
    kube.calls.clear()
    f["status"] = status
    await reconciler.reconcile(f)
    assert kube.calls == []


async def test_scale_to_is_written_into_spec_replicas_before_children():
    kube = FakeKube(inodes=[{"metadata": {"name": "x"}, "spec": {"nodeName": "z"},
                             "status": {"demand": [{"model": "m", "requests": 1,
                                                    "lastRequested": "2026-12-04T11:59:59Z"}]}}],
                    nodes=[node("a")])
    f = fleet(0, autoscaling={"minReplicas": 0, "maxReplicas": 2})
    await FleetReconciler(kube, now=lambda: NOW).reconcile(f)
    writes = [c for c in kube.calls if c[0] in ("PATCH", "ensure")]
    assert writes[0] == ("PATCH", "/apis/zerolayer.io/v1alpha1/inferencefleets/f", {"spec": {"replicas": 1}})
    assert writes[1] == ("ensure", "f-a")


async def test_invalid_spec_writes_a_condition_then_raises():
    f = fleet(1)
    f["spec"]["models"] = []
    kube = FakeKube(nodes=[node("a")])
    with pytest.raises(SpecError):
        await FleetReconciler(kube, now=lambda: NOW).reconcile(f)
    [(_, _, status)] = [c for c in kube.calls if c[0] == "status"]
    assert status["phase"] == "Degraded"
    assert any(c["reason"] == "InvalidSpec" for c in status["conditions"])
    assert not [c for c in kube.calls if c[0] in ("ensure", "delete", "PATCH")]
