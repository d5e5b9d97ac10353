"""The planner (operator/zerolayer/operator/plan.py) as tables: facts in, a Plan out, no API server.

Each row names a situation an InferenceNode or TenantQuota can be in and what the plan must say:
children, Node patch, conditions, phase, events, and whether (and how soon) to look again."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest

from zerolayer.operator import manifests as m
from zerolayer.operator import plan as p
from zerolayer.operator.config import OperatorConfig

NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op")
RETRY = CONFIG.retry_seconds


def inode(**spec):
    return {"apiVersion": m.API_VERSION, "kind": "InferenceNode",
            "metadata": {"name": "n0", "uid": "u0", "generation": 2},
            "spec": {"nodeName": "gpu-0", "models": [{"name": "tiny", "source": "/m"}], **spec}}


def node(labels=None, claim=None, gpus="8"):
    meta = {"name": "gpu-0", "labels": {m.GFD_PRODUCT_LABEL: "NVIDIA-H100", **(labels or {})}}
    if claim:
        meta["annotations"] = {m.CLAIM_ANNOTATION: claim}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta,
            "status": {"allocatable": {"nvidia.com/gpu": gpus}, "nodeInfo": {"kernelVersion": "6.8.0"}}}


def daemonset(generation=1, observed=1, desired=1, updated=1, ready=1):
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "desiredNumberScheduled": desired,
                       "updatedNumberScheduled": updated, "numberReady": ready}}


def facts(body=None, **kw):
    return p.InferenceNodeFacts(inode=body or inode(), config=CONFIG, now=NOW, **kw)


def kinds(plan):
    return [c["kind"] for c in plan.children]


def by_type(plan):
    return {c["type"]: (c["status"], c["reason"]) for c in plan.conditions}


LABELLED = node(labels=m.node_labels("NVIDIA-H100"), claim="n0")
FRESH = {"lastHeartbeat": "2026-01-01T11:59:50Z"}


# ----------------------------------------------------------------------------- InferenceNode: refusals
@pytest.mark.parametrize("situation, facts_, phase, reason, invalid, retry", [
    ("spec invalid", facts(inode(nodeName="")), "Degraded", "InvalidSpec", True, None),
    ("engine args invalid", facts(inode(runtime={"engineArgs": {"no_such_arg": 1}})), "Degraded",
     "InvalidEngineArgs", True, None),
    ("Node missing", facts(), "Pending", "NodeMissing", False, RETRY),
    ("Node served by another", facts(node=node(claim="other"), claimant={"metadata": {"name": "other"}}),
     "Degraded", "NodeClaimed", False, RETRY),
])
def test_a_refused_inference_node_writes_only_its_status(situation, facts_, phase, reason, invalid, retry):
    plan = p.plan_inference_node(facts_)
    assert plan.children == [] and plan.patches == [], situation
    assert plan.phase == phase and by_type(plan)["Ready"] == ("False", reason)
    assert bool(plan.invalid) == invalid
    assert (plan.retry.delay if plan.retry else None) == retry
    assert plan.notes and plan.notes[0].reason == reason and plan.notes[0].warning
    assert not plan.ready


def test_a_claimant_being_deleted_hands_the_node_over():
    going = {"metadata": {"name": "other", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    plan = p.plan_inference_node(facts(node=node(claim="other"), claimant=going))
    assert [x.annotations for x in plan.patches] == [{m.CLAIM_ANNOTATION: "n0"}]
    assert "DaemonSet" in kinds(plan)


def test_the_refusal_is_told_once_when_ready_flips():
    body = inode(nodeName="")
    body["status"] = {"conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec"}]}
    assert p.plan_inference_node(facts(body)).notes == []


# ----------------------------------------------------------------------------- InferenceNode: children
@pytest.mark.parametrize("situation, the_node, patched, note", [
    ("unlabelled", node(), True, True),
    ("labelled but not claimed", node(labels=m.node_labels("NVIDIA-H100")), True, False),
    ("labelled and claimed", LABELLED, False, False),
])
def test_the_node_is_labelled_and_claimed_once(situation, the_node, patched, note):
    plan = p.plan_inference_node(facts(node=the_node))
    assert bool(plan.patches) == patched, situation
    if patched:
        assert (plan.patches[0].note is not None) == note
    assert not plan.settled  # the status follows from the runtime as applied
    assert kinds(plan) == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "NetworkPolicy",
                           "Role", "RoleBinding", "DaemonSet"]


def test_missing_model_storage_holds_the_daemonset_back():
    storage = ("PVCNotFound", "PersistentVolumeClaim zl-run/models does not exist")
    plan = p.plan_inference_node(facts(node=LABELLED, storage=storage))
    assert "DaemonSet" not in kinds(plan) and len(plan.children) == 7
    assert plan.phase == "Pending" and by_type(plan)["ModelsReady"] == ("False", "PVCNotFound")
    assert [n.reason for n in plan.notes] == ["PVCNotFound", "PVCNotFound"]  # models, then Ready
    assert plan.retry == p.Retry(storage[1], RETRY)


def test_the_daemonset_is_sized_by_the_node():
    ds = p.plan_inference_node(facts(node=node(gpus="1"))).children[-1]
    assert "defragd" in [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]
    ds = p.plan_inference_node(facts(node=node(gpus="8"))).children[-1]
    assert "defragd" not in [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]


# ----------------------------------------------------------------------------- InferenceNode: status
@pytest.mark.parametrize("situation, runtime, status, phase, ready_reason, ready", [
    ("rollout not seen", daemonset(generation=2), FRESH, "Progressing", "RolloutPending", False),
    ("not scheduled", daemonset(desired=0), FRESH, "Progressing", "NotScheduled", False),
    ("rolling out", daemonset(desired=2, updated=1), FRESH, "Progressing", "RollingOut", False),
    ("pod not ready", daemonset(ready=0), FRESH, "Progressing", "PodNotReady", False),
    ("no heartbeat yet", daemonset(), {}, "Progressing", "NoHeartbeat", False),
    ("heartbeat stale", daemonset(), {"lastHeartbeat": "2026-01-01T11:00:00Z"}, "Degraded", "HeartbeatStale",
     False),
    ("serving", daemonset(), FRESH, "Ready", "RuntimeServing", True),
])
def test_the_status_follows_from_the_runtime_and_its_heartbeat(situation, runtime, status, phase, ready_reason,
                                                               ready):
    body = {**inode(), "status": status}
    plan = p.plan_inference_node(facts(body, node=LABELLED, runtime=runtime))
    assert plan.children == [] and plan.patches == []
    assert (plan.phase, by_type(plan)["Ready"][1], plan.ready) == (phase, ready_reason, ready), situation
    assert plan.retry is None


def test_a_failure_explains_more_than_a_state_not_known_yet():
    body = {**inode(), "status": {"lastHeartbeat": "2026-01-01T11:00:00Z"}}  # stale: False, RuntimeReady False
    plan = p.plan_inference_node(facts(body, node=LABELLED, runtime=daemonset(ready=0)))
    assert by_type(plan)["Ready"] == ("False", "PodNotReady")  # the first False in order


DOWNLOADED = inode(models=[{"name": "tiny", "source": {"huggingFace": {"repo": "org/tiny"}}}])


def pod(init_state):
    return {"status": {"initContainerStatuses": [{"name": "fetch-0", "state": init_state}]}}


@pytest.mark.parametrize("situation, runtime, pods, needs, models, retry", [
    ("mounted", daemonset(), None, False, ("True", "ModelsAvailable"), False),
    ("no pod yet", daemonset(ready=0), [], True, ("Unknown", "ModelDownloadPending"), True),
])
def test_downloads_are_read_from_the_pods_while_the_runtime_is_not_ready(situation, runtime, pods, needs, models,
                                                                        retry):
    f = facts(DOWNLOADED, node=LABELLED, runtime=runtime, pods=pods)
    assert p.needs_pods(f) == needs, situation
    plan = p.plan_inference_node(f)
    assert by_type(plan)["ModelsReady"] == models
    assert (plan.retry is not None) == retry
    if retry:
        assert plan.retry.delay == min(15.0, RETRY)


def test_pods_are_not_needed_before_the_runtime_is_applied_or_without_downloads():
    assert not p.needs_pods(facts(DOWNLOADED, node=LABELLED))
    assert not p.needs_pods(facts(node=LABELLED, runtime=daemonset(ready=0)))


@pytest.mark.parametrize("old, new, phase, expected", [
    (None, ("True", "RuntimeServing"), "Ready", [("Ready", False)]),
    ("True", ("True", "RuntimeServing"), "Ready", []),
    ("True", ("False", "PodNotReady"), "Progressing", [("PodNotReady", False)]),
    ("True", ("False", "HeartbeatStale"), "Degraded", [("HeartbeatStale", True)]),
    (None, ("False", "NodeMissing"), "Pending", [("NodeMissing", True)]),
])
def test_ready_flipping_is_told_once_and_a_warning_only_when_broken(old, new, phase, expected):
    body = {"status": {"conditions": [{"type": "Ready", "status": old}]}} if old else {}
    updates = [{"type": "Ready", "status": new[0], "reason": new[1], "message": "m"}]
    assert [(n.reason, n.warning) for n in p.transition_notes(body, updates, phase)] == expected


# ----------------------------------------------------------------------------- deletion
@pytest.mark.parametrize("situation, the_node, labels, annotations", [
    ("ours", node(labels=m.node_labels("NVIDIA-H100"), claim="n0"),
     {m.INFERENCE_NODE_LABEL: None, m.GPU_TYPE_LABEL: None}, {m.CLAIM_ANNOTATION: None}),
    ("claimed by another", node(labels=m.node_labels("NVIDIA-H100"), claim="other"), None, None),
    ("gone", None, None, None),
    ("nothing of ours", node(), None, None),
])
def test_deletion_releases_only_a_node_it_claimed(situation, the_node, labels, annotations):
    patch = p.release_node(inode(), the_node)
    assert (patch.labels if patch else None) == labels, situation
    assert (patch.annotations if patch else None) == annotations


# ----------------------------------------------------------------------------- TenantQuota
def tquota(name="team-a", tenant="team-a", created="2026-01-01T00:00:00Z", status=None, **spec):
    return {"apiVersion": m.API_VERSION, "kind": "TenantQuota",
            "metadata": {"name": name, "uid": "u1", "generation": 1, "creationTimestamp": created},
            "spec": {"tenant": tenant, "apiKeySecretRef": {"name": "keys"}, "namespaces": ["team-a"],
                     "tokensPerMinute": 100, "requestsPerMinute": 10, **spec}, "status": status or {}}


def tq_facts(body=None, **kw):
    kw.setdefault("key_count", 2)
    kw.setdefault("key_hashes", ("h1", "h2"))
    return p.TenantQuotaFacts(tquota=body or tquota(), config=CONFIG, **kw)


def entry(tenant, created, hashes):
    return {"tenant": tenant, "created": created, "hashes": list(hashes)}


OLDER = "2025-12-01T00:00:00Z"
NEWER = "2026-02-01T00:00:00Z"


@pytest.mark.parametrize("situation, facts_, phase, reason, invalid, retry", [
    ("spec invalid", tq_facts(tquota(tenant="")), "Degraded", "InvalidSpec", True, None),
    ("Secret namespace not allowed", tq_facts(tquota(apiKeySecretRef={"name": "k", "namespace": "kube-system"})),
     "Degraded", "SecretNamespaceNotAllowed", True, None),
    ("Secret missing", tq_facts(secret=("SecretMissing", "gone")), "Pending", "SecretMissing", False,
     min(10.0, RETRY)),
    ("tenant already declared", tq_facts(published={"old": entry("team-a", OLDER, ["x"])}), "Degraded",
     "DuplicateTenant", False, RETRY),
    ("a key already another's", tq_facts(published={"old": entry("team-b", OLDER, ["h2"])}), "Degraded",
     "DuplicateKey", False, RETRY),
])
def test_a_refused_tenant_quota_is_withdrawn_and_says_why(situation, facts_, phase, reason, invalid, retry):
    plan = p.plan_tenant_quota(facts_)
    assert plan.publication == p.Publication(None), situation  # the runtimes drop it
    assert plan.children == [] and plan.phase == phase and by_type(plan)["Ready"] == ("False", reason)
    assert bool(plan.invalid) == invalid
    assert (plan.retry.delay if plan.retry else None) == retry


def test_the_older_tenant_quota_is_told_why_the_newer_one_was_refused():
    plan = p.plan_tenant_quota(tq_facts(published={"old": entry("team-a", OLDER, ["x"])}))
    [told] = [n for n in plan.notes if n.about is not None]
    assert told.about["metadata"]["name"] == "old" and told.warning and "team-a was refused" in told.message


@pytest.mark.parametrize("situation, published", [
    ("no one else", {}),
    ("itself", {"team-a": entry("team-a", "2026-01-01T00:00:00Z", ["h1"])}),
    ("a newer one with the same tenant", {"new": entry("team-a", NEWER, ["h1"])}),
])
def test_the_older_tenant_quota_keeps_its_tenant_and_keys(situation, published):
    plan = p.plan_tenant_quota(tq_facts(published=published))
    assert plan.ready and plan.phase == "Ready", situation
    assert m.read_tenant_key_entry(plan.publication.entry)["hashes"] == ["h1", "h2"]


@pytest.mark.parametrize("cilium, kind, removed", [
    (False, "NetworkPolicy", []),
    (True, "CiliumNetworkPolicy", ["NetworkPolicy"]),
])
def test_an_admitted_tenant_gets_its_policy_and_status(cilium, kind, removed):
    plan = p.plan_tenant_quota(tq_facts(cilium=cilium))
    assert kinds(plan) == [kind] and [r.kind for r in plan.removals] == removed
    assert plan.status == {"keyCount": 2, "networkPolicies": ["zl-tenant-team-a"]}
    assert [c["type"] for c in plan.conditions] == ["SecretFound", "PoliciesApplied", "Ready"]
    assert [n.reason for n in plan.notes] == ["Ready"]


@pytest.mark.parametrize("status, checked, removed", [
    ({}, False, []),  # never reconciled: no older operator made them
    ({"conditions": [{"type": "Ready", "status": "True"}]}, False, ["RoleBinding", "Role"]),
    ({"conditions": [{"type": "Ready", "status": "True"}]}, True, []),
])
def test_the_pre_hash_secret_access_is_removed_once(status, checked, removed):
    plan = p.plan_tenant_quota(tq_facts(tquota(status=status), legacy_checked=checked))
    assert [r.kind for r in plan.removals] == removed


@pytest.mark.parametrize("found, has_key, count, reason", [
    (False, False, 0, "SecretMissing"), (True, False, 0, "KeyMissing"), (True, True, 0, "NoKeys"),
    (True, True, 3, None),
])
def test_secret_problems(found, has_key, count, reason):
    problem = p.secret_problem(found, has_key, count, "ns", "keys", "api-keys")
    assert (problem[0] if problem else None) == reason


# ----------------------------------------------------------------------------- the planner does no I/O
def test_the_planner_imports_no_kube_layer_and_no_client():
    """The import contract (.importlinter) covers zerolayer's own modules; this covers the externals."""
    code = ("import sys, zerolayer.operator.plan; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes', 'aiohttp', 'asyncio')"
            " or m in ('zerolayer.operator.kube', 'zerolayer.operator.apply', 'zerolayer.operator.reconcile')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
