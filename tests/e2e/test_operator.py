"""Issue 3 on the real local control plane: the operator as a local process reconciling
InferenceNodes on kwok GPU nodes and TenantQuotas, with labels, children, conditions,
events, drift repair, idempotency, Cilium detection and finalizer cleanup."""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import re
import time

import pytest

from tests.e2e.operator_harness import E2E_LABEL, Objects, OperatorProcess, new_run_id
from zerolayer.operator.handlers import finalizer_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CILIUM_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "ciliumnetworkpolicies.cilium.io"},
    "spec": {"group": "cilium.io", "scope": "Namespaced",
             "names": {"kind": "CiliumNetworkPolicy", "plural": "ciliumnetworkpolicies", "singular": "ciliumnetworkpolicy"},
             "versions": [{"name": "v2", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    run = new_run_id()
    namespace = f"zl-e2e-op-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path_factory.mktemp("operator"))
    operator.start()
    try:
        yield objects, operator
    finally:
        objects.delete_all(operator)
        operator.stop()


def wait_condition(cluster, objects, kind, name, type_, status="True", reason=None, timeout=90):
    def check():
        obj = objects.get(kind, name)
        c = objects.condition(obj, type_)
        return obj if c.get("status") == status and (reason is None or c.get("reason") == reason) else None
    return cluster.wait_for(check, timeout=timeout, what=f"{kind}/{name} {type_}={status} {reason or ''}")


def children(objects, name):
    child = f"zl-runtime-{name}"
    found = {k: objects.get(k, child, objects.namespace) for k in ("daemonset", "serviceaccount", "service",
                                                                   "networkpolicy", "role", "rolebinding")}
    found |= {k: objects.get(k, child) for k in ("clusterrole", "clusterrolebinding")}
    return found


def published(objects) -> dict:
    """The operator's published key hashes (Secret zl-tenant-keys), decoded, by TenantQuota name."""
    secret = objects.get("secret", "zl-tenant-keys", objects.namespace) or {}
    return {k: json.loads(base64.b64decode(v)) for k, v in (secret.get("data") or {}).items()}


def test_inference_node_labels_node_runs_runtime_and_reports(cluster, env):
    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    # All 8 GPUs of the kwok node: defragd runs only beside a runtime that holds every GPU.
    objects.apply(objects.inference_node(name, node, runtime={
        "gpus": 8, "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}))
    obj = wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")

    labels = objects.get("node", node)["metadata"]["labels"]
    assert labels["zerolayer.io/inference-node"] == "true"
    assert labels["zerolayer.io/gpu-type"] == "NVIDIA-H100-80GB-HBM3"
    kids = children(objects, name)
    assert all(kids.values()), {k: bool(v) for k, v in kids.items()}
    uid = obj["metadata"]["uid"]
    for kid in kids.values():
        assert [o["uid"] for o in kid["metadata"]["ownerReferences"]] == [uid]
    pods = objects.items("pods", objects.namespace, selector=f"zerolayer.io/inference-node={name}")
    assert [p["spec"]["nodeName"] for p in pods] == [node]
    assert {c["name"] for c in pods[0]["spec"]["containers"]} == {"server", "defragd", "auditor"}
    # this run's operator has --selector: its own finalizer name, never another operator's
    assert obj["metadata"]["finalizers"] == [finalizer_for({E2E_LABEL: objects.run_id})]

    # no heartbeat yet: progressing, not ready, and the status says why
    assert obj["status"]["phase"] == "Progressing"
    assert objects.condition(obj, "GossipFresh")["reason"] == "NoHeartbeat"
    assert objects.condition(obj, "Ready")["status"] == "False"
    assert objects.condition(obj, "Ready")["observedGeneration"] == obj["metadata"]["generation"]

    objects.heartbeat(name)
    obj = wait_condition(cluster, objects, "inferencenode", name, "Ready")
    assert obj["status"]["phase"] == "Ready"

    # one event per reconcile lists its actions, "; "-separated
    messages = [part for e in objects.events("InferenceNode", name) for part in e["message"].split("; ")]
    assert any(m.startswith(f"Labelled node {node}") for m in messages), messages
    assert f"Created DaemonSet {objects.namespace}/zl-runtime-{name}" in messages
    assert any("publishing its GPU map" in m for m in messages)
    described = cluster.kubectl("describe", "inferencenode", name).stdout
    assert "RuntimeReady" in described and "Created DaemonSet" in described


def test_missing_node_is_reported_then_picked_up(cluster, env):
    objects, operator = env
    node = f"zl-e2e-{objects.run_id}-late"
    name = f"{node}-inode"
    objects.apply(objects.inference_node(name, node))
    obj = wait_condition(cluster, objects, "inferencenode", name, "NodeFound", "False", "NodeMissing")
    assert obj["status"]["phase"] == "Pending"
    assert objects.get("daemonset", f"zl-runtime-{name}", objects.namespace) is None
    warnings = [e for e in objects.events("InferenceNode", name) if e["type"] == "Warning"]
    assert any("does not exist" in e["message"] for e in warnings)

    objects.nodes.append(node)
    from zerolayer.cluster.local import node_manifest
    objects.apply(node_manifest(node))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")


def test_drift_is_repaired(cluster, env):
    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    objects.apply(objects.inference_node(name, node))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")
    child = f"zl-runtime-{name}"
    before = {k: v["metadata"]["uid"] for k, v in children(objects, name).items()}

    cluster.kubectl("delete", "daemonset", child, "-n", objects.namespace)
    cluster.kubectl("delete", "networkpolicy", child, "-n", objects.namespace)
    cluster.kubectl("delete", "clusterrole", child)
    cluster.kubectl("label", "node", node, "zerolayer.io/inference-node-")
    cluster.kubectl("patch", "service", child, "-n", objects.namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"selector": {"app.kubernetes.io/name": "someone-else"}}}))

    def repaired():
        kids = children(objects, name)
        labelled = objects.get("node", node)["metadata"]["labels"].get("zerolayer.io/inference-node") == "true"
        selector = (kids["service"] or {}).get("spec", {}).get("selector", {})
        return all(kids.values()) and labelled and selector.get("app.kubernetes.io/name") == "zerolayer-runtime" \
            and kids
    kids = cluster.wait_for(repaired, timeout=60, what="drift repaired")
    for kind in ("daemonset", "networkpolicy", "clusterrole"):
        assert kids[kind]["metadata"]["uid"] != before[kind]  # recreated
    assert kids["serviceaccount"]["metadata"]["uid"] == before["serviceaccount"]  # untouched
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")


SETTLE = 3.0  # seconds between two looks at a converged object


def test_converged_state_is_left_alone(cluster, env):
    """Level-triggered and idempotent: a converged object is written no more (no timers run,
    watch events of our own writes trigger nothing), and no API request of the operator has
    ended in 409."""
    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    objects.apply(objects.inference_node(name, node))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")

    def versions():
        kids = children(objects, name)
        return {k: v["metadata"]["resourceVersion"] for k, v in kids.items()} | \
            {"inferencenode": objects.get("inferencenode", name)["metadata"]["resourceVersion"],
             "node-labels": json.dumps(objects.get("node", node)["metadata"]["labels"], sort_keys=True)}

    def stable():
        # the DaemonSet controller may still be writing status right after readiness
        before = versions()
        time.sleep(SETTLE * 2)
        return before if versions() == before else None

    first = cluster.wait_for(stable, timeout=90, interval=0, what="stable resource versions")
    time.sleep(SETTLE * 4)  # the watch events of its own writes have long arrived: nothing may change
    assert versions() == first
    metrics = operator.get(operator.metrics_port, "/metrics") or ""
    conflicts = [l for l in metrics.splitlines()
                 if l.startswith("zerolayer_operator_api_requests_total") and 'code="409"' in l]
    assert conflicts == [], conflicts


def test_tenant_quota_waits_for_its_secret_then_admits_its_namespaces(cluster, env):
    objects, operator = env
    run = objects.run_id
    tq, secret = f"tenant-{run}", f"keys-{run}"
    objects.apply(objects.tenant_quota(tq, secret, namespaces=("team-x", "team-y")))
    obj = wait_condition(cluster, objects, "tenantquota", tq, "SecretFound", "False", "SecretMissing")
    assert obj["status"]["phase"] == "Pending"
    assert objects.get("networkpolicy", f"zl-tenant-{tq}", objects.namespace) is None

    objects.apply(objects.secret(secret, keys="sk-e2e-very-secret-1\nsk-e2e-very-secret-2\n"))
    obj = wait_condition(cluster, objects, "tenantquota", tq, "Ready")
    assert obj["status"]["keyCount"] == 2 and obj["status"]["phase"] == "Ready"
    policy = objects.get("networkpolicy", f"zl-tenant-{tq}", objects.namespace)
    peer = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert peer["values"] == ["team-x", "team-y"]
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": "serving", "protocol": "TCP"}]
    # Runtimes get SHA-256 hashes of the keys, published in the one Secret zl-tenant-keys; nothing
    # lets them read the tenant's own Secret.
    entry = published(objects)[tq]
    assert entry["tenant"] == tq
    assert entry["hashes"] == sorted(hashlib.sha256(k.encode()).hexdigest()
                                     for k in ("sk-e2e-very-secret-1", "sk-e2e-very-secret-2"))
    assert objects.get("role", f"zl-tenant-{tq}", objects.namespace) is None
    assert objects.get("rolebinding", f"zl-tenant-{tq}", objects.namespace) is None

    # the auditor's usage survives the operator's reconciles
    cluster.kubectl("patch", "tenantquota", tq, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"usage": {"tokensThisWindow": 77}}}))
    cluster.kubectl("patch", "tenantquota", tq, "--type=merge", "-p", json.dumps({"spec": {"namespaces": ["team-z"]}}))
    cluster.wait_for(lambda: objects.get("networkpolicy", f"zl-tenant-{tq}", objects.namespace)["spec"]["ingress"][0]
                     ["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["team-z"],
                     timeout=60, what="policy follows spec.namespaces")
    obj = wait_condition(cluster, objects, "tenantquota", tq, "PoliciesApplied")
    assert obj["status"]["usage"] == {"tokensThisWindow": 77}

    # the keys never show up in status, events or the operator's log
    text = json.dumps(obj) + json.dumps(objects.events("TenantQuota", tq)) + operator.log()
    assert "sk-e2e-very-secret" not in text


def test_runtime_rbac_is_what_the_runtime_needs(cluster, env):
    """The runtime's service account may patch its own InferenceNode's status, not another's,
    read TenantQuotas and the published key hashes (zl-tenant-keys), not a tenant's Secret, and
    nothing else."""
    objects, operator = env
    run = objects.run_id
    nodes = objects.add_nodes(2)
    names = [f"{n}-inode" for n in nodes]
    objects.apply(*(objects.inference_node(n, node) for n, node in zip(names, nodes)))
    tq, secret = f"rbac-{run}", f"rbac-keys-{run}"
    objects.apply(objects.secret(secret), objects.tenant_quota(tq, secret))
    for n in names:
        wait_condition(cluster, objects, "inferencenode", n, "NodeLabelled")
    wait_condition(cluster, objects, "tenantquota", tq, "Ready")
    sa = f"system:serviceaccount:{objects.namespace}:zl-runtime-{names[0]}"

    def can(*args):
        return cluster.kubectl("auth", "can-i", *args, "--as", sa, check=False).stdout.strip() == "yes"
    assert can("patch", f"inferencenodes.zerolayer.io/{names[0]}", "--subresource=status")
    assert not can("patch", f"inferencenodes.zerolayer.io/{names[1]}", "--subresource=status")
    assert not can("patch", f"inferencenodes.zerolayer.io/{names[0]}")
    assert can("watch", "tenantquotas.zerolayer.io")
    assert not can("update", "tenantquotas.zerolayer.io")
    assert can("get", "secret/zl-tenant-keys", "-n", objects.namespace)
    assert not can("list", "secrets", "-n", objects.namespace)
    assert not can("get", f"secret/{secret}", "-n", objects.namespace)
    assert not can("get", "secret/something-else", "-n", objects.namespace)
    assert not can("list", "pods", "-n", objects.namespace)


def test_health_and_metrics_endpoints(cluster, env):
    objects, operator = env
    health = cluster.wait_for(lambda: operator.get(operator.health_port, "/healthz"), timeout=30,
                              what="the operator's /healthz")
    assert "reconciles" in json.loads(health)  # kopf's endpoint: this replica leads
    metrics = operator.get(operator.metrics_port, "/metrics")
    # children are created by server-side apply (201), not by a read and a create
    assert re.search(r'zerolayer_operator_api_requests_total\{code="201",resource="daemonsets",verb="apply"\}',
                     metrics)
    assert "zerolayer_operator_reconciles_total" in metrics


def test_deletion_removes_labels_and_children(cluster, env):
    objects, operator = env
    [node] = objects.add_nodes(1)
    name = f"{node}-inode"
    tq, secret = f"gone-{objects.run_id}", f"gone-keys-{objects.run_id}"
    objects.apply(objects.inference_node(name, node), objects.secret(secret), objects.tenant_quota(tq, secret))
    wait_condition(cluster, objects, "inferencenode", name, "RuntimeReady")
    wait_condition(cluster, objects, "tenantquota", tq, "Ready")

    cluster.kubectl("delete", "inferencenode", name, "--timeout=60s")
    cluster.kubectl("delete", "tenantquota", tq, "--timeout=60s")
    labels = objects.get("node", node)["metadata"]["labels"]
    assert "zerolayer.io/inference-node" not in labels and "zerolayer.io/gpu-type" not in labels
    # Children go in the finalizer; a DaemonSet deleted in the foreground lingers until its pods are gone.
    cluster.wait_for(lambda: not any(children(objects, name).values()), timeout=60, what="children deleted")
    for kind in ("networkpolicy", "role", "rolebinding"):
        assert objects.get(kind, f"zl-tenant-{tq}", objects.namespace) is None
    assert tq not in published(objects)  # its keys no longer authenticate anywhere
    messages = [part for e in objects.events("InferenceNode", name) for part in e["message"].split("; ")]
    assert any(m.startswith(f"Removed labels") for m in messages)
    assert f"Deleted DaemonSet {objects.namespace}/zl-runtime-{name}" in messages


def test_with_cilium_crd_the_tenant_gets_an_l7_policy(cluster, env):
    """Runs last in this module: it installs the CiliumNetworkPolicy CRD (schema only; no Cilium
    agent enforces it here) and removes it afterwards."""
    objects, operator = env
    tq, secret = f"l7-{objects.run_id}", f"l7-keys-{objects.run_id}"
    existed = objects.get("crd", CILIUM_CRD["metadata"]["name"]) is not None
    if not existed:
        objects.apply(CILIUM_CRD)
        cluster.wait_established("ciliumnetworkpolicies.cilium.io")
    try:
        objects.apply(objects.secret(secret), objects.tenant_quota(tq, secret, namespaces=("team-l7",)))
        cnp = cluster.wait_for(lambda: objects.get("ciliumnetworkpolicy", f"zl-tenant-{tq}", objects.namespace),
                               timeout=90, what="CiliumNetworkPolicy")
        rule = cnp["spec"]["ingress"][0]
        assert rule["fromEndpoints"] == [{"matchLabels": {"k8s:io.kubernetes.pod.namespace": "team-l7"}}]
        assert rule["toPorts"][0]["rules"]["http"] == [{"headers": ["x-api-key"]}, {"headers": ["authorization"]}]
        obj = wait_condition(cluster, objects, "tenantquota", tq, "PoliciesApplied")
        assert "CiliumNetworkPolicy" in objects.condition(obj, "PoliciesApplied")["message"]
        assert objects.get("networkpolicy", f"zl-tenant-{tq}", objects.namespace) is None
        cluster.kubectl("delete", "tenantquota", tq, "--timeout=60s")
        assert objects.get("ciliumnetworkpolicy", f"zl-tenant-{tq}", objects.namespace) is None
    finally:
        if not existed:
            cluster.kubectl("delete", "crd", CILIUM_CRD["metadata"]["name"], "--wait=false", check=False)


def test_operator_works_with_only_its_documented_rbac(cluster, tmp_path):
    """Run a second operator as a ServiceAccount holding exactly zerolayer.operator.rbac's rules
    (what the Helm chart must grant) and check it converges and cleans up."""
    import yaml
    from zerolayer.operator import rbac

    run = new_run_id()
    ns = f"zl-e2e-rbac-{run}"
    objects = Objects(cluster, ns, run)
    operator = OperatorProcess(cluster, ns, run, tmp_path)
    name = f"zl-e2e-operator-{run}"
    cluster.kubectl("create", "namespace", ns)
    try:
        objects.apply(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "operator", "namespace": ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
             "rules": rbac.CLUSTER_RULES},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": ns}]},
            # the operator's namespace is the runtime namespace here: both rule sets in one Role
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, "namespace": ns},
             "rules": rbac.RUNTIME_NAMESPACE_RULES + rbac.operator_namespace_rules()},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": name, "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": ns}]},
        )
        token = cluster.kubectl("create", "token", "operator", "-n", ns, "--duration=1h").stdout.strip()
        config = yaml.safe_load(pathlib.Path(cluster.kubeconfig).read_text())
        config["users"] = [{"name": "operator", "user": {"token": token}}]
        for ctx in config["contexts"]:
            ctx["context"]["user"] = "operator"
        kubeconfig = tmp_path / "operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        operator.kubeconfig = str(kubeconfig)
        operator.start()

        [node] = objects.add_nodes(1)
        inode, tq, secret = f"{node}-inode", f"rbac-op-{run}", f"rbac-op-keys-{run}"
        objects.apply(objects.inference_node(inode, node), objects.secret(secret), objects.tenant_quota(tq, secret))
        wait_condition(cluster, objects, "inferencenode", inode, "RuntimeReady")
        wait_condition(cluster, objects, "tenantquota", tq, "Ready")
        assert all(children(objects, inode).values())
        cluster.kubectl("delete", "inferencenode", inode, "--timeout=60s")
        cluster.kubectl("delete", "tenantquota", tq, "--timeout=60s")
        cluster.wait_for(lambda: not any(children(objects, inode).values()), timeout=60, what="children deleted")
        # our KubeError says "403 Forbidden", kopf's APIForbiddenError; both contain the word
        assert "Forbidden" not in operator.log(), operator.log()[-3000:]
    finally:
        objects.delete_all(operator)
        operator.stop()
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", name, "--ignore-not-found", check=False)
