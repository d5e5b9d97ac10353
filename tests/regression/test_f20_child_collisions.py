"""Review finding 20: ``a.b`` and ``a-b`` map to the same child names; ``ensure()`` adopted and
patched a child whose controller was the other object, and the finalizer deleted children by name.
Now a child controlled by someone else is refused with a condition, never patched or deleted."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.regression.manifest_fixtures import CONFIG
from tests.unit.operator.fakes import FakeKube
from zerolayer.operator import manifests as m
from zerolayer.operator.reconcile import Reconciler

pytestmark = [pytest.mark.regression]


def world():  # type: ignore[no-untyped-def]
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-0"}})
    kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    bodies = []
    for name, node, uid in (("a.b", "gpu-node-0", "uid-dot"), ("a-b", "gpu-node-1", "uid-dash")):
        bodies.append(kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
                                "metadata": {"name": name, "uid": uid},
                                "spec": {"nodeName": node, "models": [{"name": "m", "source": {"path": "/m"}}]}}))
    return kube, Reconciler(kube, CONFIG), bodies


def test_a_child_controlled_by_another_object_is_not_adopted_or_deleted():
    kube, rec, (dot, dash) = world()
    assert m.runtime_name("a.b") == m.runtime_name("a-b")  # the collision itself
    try:
        asyncio.run(rec.reconcile_inference_node(dot))
    except Exception:  # noqa: BLE001 - progress or waiting: only the children matter here
        pass
    child = m.runtime_name("a.b")
    theirs = copy.deepcopy(kube.find("apps/v1", "DaemonSet", child, CONFIG.runtime_namespace))
    assert theirs["metadata"]["ownerReferences"][0]["uid"] == "uid-dot"
    with pytest.raises(Exception):
        asyncio.run(rec.reconcile_inference_node(dash))
    assert kube.find("apps/v1", "DaemonSet", child, CONFIG.runtime_namespace) == theirs, "patched someone else's"
    ready = {c["type"]: c for c in kube.find("zerolayer.io/v1alpha1", "InferenceNode", "a-b")["status"]["conditions"]}
    assert ready["Ready"]["status"] == "False" and ready["Ready"]["reason"] == "ChildConflict"
    assert "a.b" in ready["Ready"]["message"]
    asyncio.run(rec.delete_inference_node(dash))
    assert kube.find("apps/v1", "DaemonSet", child, CONFIG.runtime_namespace) is not None, "deleted someone else's"
