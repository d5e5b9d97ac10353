"""The reconciler against FakeKube (tests/unit/operator/fakes.py): idempotency, conditions,
events, waiting for missing dependencies, finalizer cleanup, drift repair."""

import asyncio
import copy
import datetime

import pytest

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import KubeError, SpecError
from zerolayer.operator.reconcile import Reconciler, WaitingFor

from .fakes import FakeKube

NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op")
RUNTIME_KINDS = ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "NetworkPolicy", "Role", "RoleBinding", "Service",
                 "ServiceAccount"]


def world(with_node=True):
    kube = FakeKube()
    if with_node:
        kube.put({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": "gpu-node-0", "labels": {m.GFD_PRODUCT_LABEL: "NVIDIA-H100"}}})
    inode = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
                      "metadata": {"name": "gpu-node-0", "generation": 3},
                      "spec": {"nodeName": "gpu-node-0", "models": [{"name": "tiny", "source": "/m"}]}})
    return kube, Reconciler(kube, CONFIG, now=lambda: NOW), inode


def current(kube, kind="InferenceNode", name="gpu-node-0"):
    return kube.find("zerolayer.io/v1alpha1", kind, name)


def snapshot(kube, kind="InferenceNode", name="gpu-node-0"):
    """What kopf would hand a handler: a copy, not the stored object."""
    return copy.deepcopy(current(kube, kind, name))


def conditions(obj):
    return {c["type"]: c for c in obj["status"]["conditions"]}


def mark_runtime_ready(kube):
    ds = kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    ds["status"] = {"desiredNumberScheduled": 1, "numberReady": 1, "updatedNumberScheduled": 1,
                    "observedGeneration": 1}


def heartbeat(kube, at=NOW):
    current(kube)["status"]["lastHeartbeat"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_first_reconcile_labels_node_creates_children_and_reports_progress():
    kube, rec, inode = world()
    outcome = await rec.reconcile_inference_node(inode)
    node = kube.find("v1", "Node", "gpu-node-0")
    assert node["metadata"]["labels"][m.INFERENCE_NODE_LABEL] == "true"
    assert node["metadata"]["labels"][m.GPU_TYPE_LABEL] == "NVIDIA-H100"
    for kind in RUNTIME_KINDS:
        assert kube.kinds(kind) == ["zl-runtime-gpu-node-0"], kind
    status = current(kube)["status"]
    assert status["phase"] == "Progressing" and status["observedGeneration"] == 3
    c = conditions(current(kube))
    assert c["NodeLabelled"]["status"] == "True"
    assert c["RuntimeReady"]["status"] == "False"  # the DaemonSet controller has not reported yet
    assert c["GossipFresh"]["status"] == "Unknown"
    assert c["Ready"]["status"] == "False" and c["Ready"]["observedGeneration"] == 3
    # one event tells the whole reconcile (one request, not one per child)
    [(kind, name, reason, message, warning)] = kube.events
    assert reason == "Reconciled" and not warning
    parts = message.split("; ")
    assert sum(p.startswith("Created ") for p in parts) == 8 and any(p.startswith("Labelled node") for p in parts)
    assert "Created DaemonSet zl-run/zl-runtime-gpu-node-0" in parts
    assert outcome.actions == parts
    assert not outcome.ready


class BindRefusingKube(FakeKube):
    """FakeKube that refuses a binding to a role not created yet, as the API server does for a
    client without the ``bind`` verb (the operator's case), after yielding once so that writes
    sent together interleave as they do over the network."""

    async def ensure(self, desired):
        await asyncio.sleep(0)
        ref = desired.get("roleRef")
        if ref is not None:
            namespace = desired["metadata"].get("namespace") if ref["kind"] == "Role" else None
            if self.find("rbac.authorization.k8s.io/v1", ref["kind"], ref["name"], namespace) is None:
                raise KubeError(f"{desired['kind']} {desired['metadata']['name']}: {ref['kind']} not found: "
                                "may not bind", status=403, reason="Forbidden")
        return await super().ensure(desired)


async def test_roles_are_written_before_their_bindings_and_the_pod_after_both():
    # CI once saw the runtime pod start with no ClusterRoleBinding: the binding was sent beside its
    # ClusterRole, reached the API server first, was refused, and the pod ran 403 until a retry.
    kube = BindRefusingKube()
    kube.objects = world()[0].objects
    rec = Reconciler(kube, CONFIG, now=lambda: NOW)
    await rec.reconcile_inference_node(current(kube))
    for kind in RUNTIME_KINDS:
        assert kube.kinds(kind) == ["zl-runtime-gpu-node-0"], kind
    order = [w[2] for w in kube.writes if w[0] == "create"]
    assert max(order.index(k) for k in ("ClusterRole", "Role", "ServiceAccount")) < \
        min(order.index(k) for k in ("ClusterRoleBinding", "RoleBinding")) < order.index("DaemonSet")
    assert order.index("ClusterRoleBinding") < order.index("DaemonSet")


async def test_second_reconcile_writes_nothing_and_emits_no_event():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    writes, events = len(kube.writes), len(kube.events)
    outcome = await rec.reconcile_inference_node(snapshot(kube))
    assert kube.writes[writes:] == [] and kube.events[events:] == []
    assert outcome.actions == []


async def test_ready_needs_runtime_pod_and_fresh_gossip():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    mark_runtime_ready(kube)
    await rec.reconcile_inference_node(snapshot(kube))
    assert conditions(current(kube))["RuntimeReady"]["status"] == "True"
    assert current(kube)["status"]["phase"] == "Progressing"
    heartbeat(kube)
    outcome = await rec.reconcile_inference_node(snapshot(kube))
    assert outcome.ready and current(kube)["status"]["phase"] == "Ready"
    assert conditions(current(kube))["Ready"]["status"] == "True"
    assert kube.events[-1][2] == "Ready"
    # heartbeat goes stale: Degraded, with a warning event saying why
    heartbeat(kube, NOW - datetime.timedelta(minutes=5))
    await rec.reconcile_inference_node(snapshot(kube))
    assert current(kube)["status"]["phase"] == "Degraded"
    assert conditions(current(kube))["GossipFresh"]["reason"] == "HeartbeatStale"
    assert kube.events[-1][2] == "HeartbeatStale" and kube.events[-1][4] is True


async def test_missing_node_is_a_condition_and_a_retry():
    kube, rec, inode = world(with_node=False)
    with pytest.raises(WaitingFor) as err:
        await rec.reconcile_inference_node(inode)
    assert err.value.delay > 0
    c = conditions(current(kube))
    assert c["NodeFound"]["status"] == "False" and c["NodeFound"]["reason"] == "NodeMissing"
    assert current(kube)["status"]["phase"] == "Pending"
    assert kube.kinds("DaemonSet") == []
    assert "gpu-node-0" in rec.nodes.missing


async def test_invalid_spec_is_permanent_and_visible():
    kube, rec, inode = world()
    inode["spec"]["models"] = [{"name": "a", "default": True}, {"name": "b", "default": True}]
    with pytest.raises(SpecError):
        await rec.reconcile_inference_node(inode)
    c = conditions(current(kube))
    assert c["Ready"]["reason"] == "InvalidSpec" and "only one model" in c["Ready"]["message"]
    assert kube.kinds("DaemonSet") == []


async def test_drift_is_repaired():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    await kube.delete("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    del kube.find("v1", "Node", "gpu-node-0")["metadata"]["labels"][m.INFERENCE_NODE_LABEL]
    kube.find("networking.k8s.io/v1", "NetworkPolicy", "zl-runtime-gpu-node-0", "zl-run")["spec"]["ingress"] = []
    outcome = await rec.reconcile_inference_node(snapshot(kube))
    assert kube.kinds("DaemonSet") == ["zl-runtime-gpu-node-0"]
    assert kube.find("v1", "Node", "gpu-node-0")["metadata"]["labels"][m.INFERENCE_NODE_LABEL] == "true"
    assert kube.find("networking.k8s.io/v1", "NetworkPolicy", "zl-runtime-gpu-node-0", "zl-run")["spec"]["ingress"]
    assert sorted(a.split()[0] for a in outcome.actions) == ["Created", "Labelled", "Updated"]


async def test_spec_change_patches_the_daemonset():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    body = current(kube)
    body["spec"]["runtime"] = {"image": "new:2"}
    outcome = await rec.reconcile_inference_node(body)
    assert outcome.actions == ["Updated DaemonSet zl-run/zl-runtime-gpu-node-0"]
    ds = kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    assert {c["image"] for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "server"} == {"new:2"}


async def test_delete_removes_labels_and_children_once():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    await rec.delete_inference_node(snapshot(kube))
    assert current(kube)["status"]["phase"] == "Terminating"
    labels = kube.find("v1", "Node", "gpu-node-0")["metadata"]["labels"]
    assert m.INFERENCE_NODE_LABEL not in labels and m.GPU_TYPE_LABEL not in labels
    assert labels[m.GFD_PRODUCT_LABEL] == "NVIDIA-H100"  # not ours: untouched
    for kind in RUNTIME_KINDS:
        assert kube.kinds(kind) == [], kind
    again = await rec.delete_inference_node(snapshot(kube))
    assert again.actions == []


# ----------------------------------------------------------------------------- TenantQuota
def tq_world(secret=True, cilium=False):
    kube = FakeKube()
    if secret:
        kube.secrets[("zl-run", "team-a-keys")] = {"api-keys": "sk-secret-1\nsk-secret-2\n"}
    if cilium:
        kube.crds.add(m.CILIUM_CRD)
    body = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
                     "metadata": {"name": "team-a", "generation": 1},
                     "spec": {"tenant": "team-a", "apiKeySecretRef": {"name": "team-a-keys"},
                              "namespaces": ["team-a"], "tokensPerMinute": 100, "requestsPerMinute": 10},
                     "status": {"usage": {"tokensThisWindow": 42}}})
    return kube, Reconciler(kube, CONFIG, now=lambda: NOW), body


def tq(kube):
    return current(kube, "TenantQuota", "team-a")


async def test_tenant_quota_creates_policy_publishes_key_hashes_and_keeps_usage():
    from zerolayer.runtime.tenants import key_hash

    kube, rec, body = tq_world()
    outcome = await rec.reconcile_tenant_quota(body)
    assert outcome.ready
    assert kube.kinds("NetworkPolicy") == ["zl-tenant-team-a"]
    assert kube.kinds("Role") == [] and kube.kinds("RoleBinding") == []  # runtimes read no tenant Secret
    assert kube.published_tenant_keys("zl-run")["team-a"]["hashes"] == sorted(
        [key_hash("sk-secret-1"), key_hash("sk-secret-2")])
    assert "sk-secret" not in repr(kube.objects)
    status = tq(kube)["status"]
    assert status["phase"] == "Ready" and status["keyCount"] == 2
    assert status["networkPolicies"] == ["zl-tenant-team-a"]
    assert status["usage"] == {"tokensThisWindow": 42}  # the auditor's field is left alone
    writes = len(kube.writes)
    await rec.reconcile_tenant_quota(snapshot(kube, "TenantQuota", "team-a"))
    assert kube.writes[writes:] == []


async def test_missing_secret_waits_and_never_leaks_values():
    kube, rec, body = tq_world(secret=False)
    with pytest.raises(WaitingFor):
        await rec.reconcile_tenant_quota(body)
    c = conditions(tq(kube))
    assert c["SecretFound"]["reason"] == "SecretMissing" and tq(kube)["status"]["phase"] == "Pending"
    assert kube.kinds("NetworkPolicy") == []
    kube.secrets[("zl-run", "team-a-keys")] = {"api-keys": "sk-secret-1\n"}
    await rec.reconcile_tenant_quota(snapshot(kube, "TenantQuota", "team-a"))
    assert tq(kube)["status"]["phase"] == "Ready"
    blob = repr(tq(kube)["status"]) + repr(kube.events)
    assert "sk-secret" not in blob


async def test_empty_key_entry_is_not_ready():
    kube, rec, body = tq_world(secret=False)
    kube.secrets[("zl-run", "team-a-keys")] = {"api-keys": "\n\n"}
    with pytest.raises(WaitingFor):
        await rec.reconcile_tenant_quota(body)
    assert conditions(tq(kube))["SecretFound"]["reason"] == "NoKeys"


async def test_with_cilium_the_l7_policy_replaces_the_plain_one():
    kube, rec, body = tq_world()
    await rec.reconcile_tenant_quota(body)
    assert kube.kinds("NetworkPolicy") == ["zl-tenant-team-a"]
    kube.crds.add(m.CILIUM_CRD)
    await rec.reconcile_tenant_quota(snapshot(kube, "TenantQuota", "team-a"))
    assert kube.kinds("CiliumNetworkPolicy") == ["zl-tenant-team-a"]
    assert kube.kinds("NetworkPolicy") == []
    assert "CiliumNetworkPolicy" in conditions(tq(kube))["PoliciesApplied"]["message"]


async def test_tenant_quota_delete_cleans_up():
    kube, rec, body = tq_world()
    await rec.reconcile_tenant_quota(body)
    await rec.delete_tenant_quota(snapshot(kube, "TenantQuota", "team-a"))
    assert kube.kinds("NetworkPolicy") == kube.kinds("Role") == kube.kinds("RoleBinding") == []
    assert kube.published_tenant_keys("zl-run") == {}


async def test_a_never_reconciled_tenant_quota_costs_no_legacy_cleanup():
    """No status yet: no older operator ever made its Role, so no DELETE requests are spent."""
    kube, rec, body = tq_world()
    await rec.reconcile_tenant_quota(body)
    assert not [w for w in kube.writes if w[0] == "delete"]


async def test_secret_namespace_change_publishes_the_new_keys_and_drops_legacy_secret_access():
    from zerolayer.runtime.tenants import key_hash

    kube, rec, body = tq_world()
    legacy = {"apiVersion": "rbac.authorization.k8s.io/v1", "metadata": {"name": "zl-tenant-team-a",
                                                                         "namespace": "zl-run"}}
    kube.put({**legacy, "kind": "Role"})
    kube.put({**legacy, "kind": "RoleBinding"})
    # reconciled before (by an older operator): its legacy Role and RoleBinding are removed
    body = {**body, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    await rec.reconcile_tenant_quota(body)
    assert kube.kinds("Role") == kube.kinds("RoleBinding") == []
    kube.secrets[("team-a", "team-a-keys")] = {"api-keys": "k\n"}  # the tenant's own namespace: allowed
    kube.secret_labels[("team-a", "team-a-keys")] = {"zerolayer.io/tenant-keys": "team-a"}  # once opted in
    new = snapshot(kube, "TenantQuota", "team-a")
    old = {"spec": dict(new["spec"])}
    new["spec"] = {**new["spec"], "apiKeySecretRef": {"name": "team-a-keys", "namespace": "team-a"}}
    await rec.reconcile_tenant_quota(new, old)
    assert kube.published_tenant_keys("zl-run")["team-a"]["hashes"] == [key_hash("k")]


async def test_a_second_inference_node_for_the_same_node_is_refused_until_the_first_goes():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)
    node = kube.find("v1", "Node", "gpu-node-0")
    assert node["metadata"]["annotations"][m.CLAIM_ANNOTATION] == "gpu-node-0"
    second = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
                       "metadata": {"name": "second"},
                       "spec": {"nodeName": "gpu-node-0", "models": [{"name": "tiny", "source": "/m"}]}})
    with pytest.raises(WaitingFor):
        await rec.reconcile_inference_node(copy.deepcopy(second))
    c = conditions(current(kube, name="second"))
    assert c["NodeLabelled"]["reason"] == "NodeClaimed" and "gpu-node-0" in c["NodeLabelled"]["message"]
    assert "zl-runtime-second" not in kube.kinds("DaemonSet")
    # deleting the refused one leaves the first one's node alone
    await rec.delete_inference_node(snapshot(kube, name="second"))
    assert node["metadata"]["labels"][m.INFERENCE_NODE_LABEL] == "true"
    # once the first is gone the second takes the node over
    await rec.delete_inference_node(snapshot(kube))
    del kube.objects[("zerolayer.io/v1alpha1", "InferenceNode", None, "gpu-node-0")]
    assert m.CLAIM_ANNOTATION not in node["metadata"].get("annotations", {})
    await rec.reconcile_inference_node(snapshot(kube, name="second"))
    assert node["metadata"]["annotations"][m.CLAIM_ANNOTATION] == "second"
    assert "zl-runtime-second" in kube.kinds("DaemonSet")
