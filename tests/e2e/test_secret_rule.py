"""Issue 28, item 3 (docs/security.md, finding 37) against the real API server and operator.

The reported attack, a TenantQuota whose ``apiKeySecretRef`` names a Secret in kube-system, is
refused at admission by the CRD's CEL rule, with its message. A quota that lists a namespace and
names a Secret there which has not opted in is admitted by the API server but refused by the
operator: ``Ready=False`` / ``SecretNotOptedIn``, ``keyCount: 0``, no entry in ``zl-tenant-keys``, no
NetworkPolicy, and a warning Event saying which label is missing. Once the Secret's owner labels it
``zerolayer.io/tenant-keys: <tenant>`` the same quota becomes Ready.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id
from zerolayer.cluster.local import ClusterError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
LABEL = "zerolayer.io/tenant-keys"


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    run = new_run_id()
    namespace, victim = f"zl-e2e-rule-{run}", f"zl-e2e-victim-{run}"
    for ns in (namespace, victim):
        cluster.kubectl("create", "namespace", ns)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path_factory.mktemp("operator"))
    operator.start()
    try:
        yield objects, operator, victim
    finally:
        objects.delete_all(operator)
        operator.stop()
        cluster.kubectl("delete", "namespace", victim, "--wait=false", check=False)


def test_a_key_secret_in_kube_system_is_refused_by_the_crd(cluster, env):
    objects, _, _ = env
    quota = objects.tenant_quota(f"evil-{objects.run_id}", "bootstrap-token-abcdef", namespaces=("kube-system",))
    quota["spec"]["apiKeySecretRef"]["namespace"] = "kube-system"
    with pytest.raises(ClusterError) as refused:
        objects.apply(quota)
    message = str(refused.value)
    assert "the operator never reads API keys from a system namespace" in message, message
    assert objects.get("tenantquota", quota["metadata"]["name"]) is None


def test_a_secret_that_has_not_opted_in_is_refused_with_a_condition_and_an_event(cluster, env):
    objects, operator, victim = env
    run = objects.run_id
    tq, secret = f"grab-{run}", f"db-credentials-{run}"
    objects.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                   "metadata": {"name": secret, "namespace": victim},
                   "stringData": {"api-keys": f"hunter2-{run}\n"}})
    quota = objects.tenant_quota(tq, secret, namespaces=(victim,))
    quota["spec"]["apiKeySecretRef"]["namespace"] = victim
    objects.apply(quota)

    def refused():  # type: ignore[no-untyped-def]
        obj = objects.get("tenantquota", tq)
        return obj if objects.condition(obj, "Ready").get("reason") == "SecretNotOptedIn" else None

    obj = cluster.wait_for(refused, timeout=90, what=f"tenantquota/{tq} Ready=False SecretNotOptedIn")
    ready = objects.condition(obj, "Ready")
    assert ready["status"] == "False" and LABEL in ready["message"], ready
    assert obj["status"]["keyCount"] == 0 and obj["status"]["phase"] == "Pending"
    keys = objects.get("secret", "zl-tenant-keys", objects.namespace) or {}
    assert tq not in (keys.get("data") or {})
    assert objects.get("networkpolicy", f"zl-tenant-{tq}", objects.namespace) is None
    warnings = cluster.wait_for(
        lambda: [e for e in objects.events("TenantQuota", tq) if e["type"] == "Warning"
                 and e["reason"] == "SecretNotOptedIn"], timeout=30, what="a SecretNotOptedIn warning event")
    assert LABEL in warnings[0]["message"]
    assert f"hunter2-{run}" not in operator.log() + json.dumps(obj)

    # The Secret's owner opts in: the same quota is admitted.
    cluster.kubectl("label", "secret", secret, "-n", victim, f"{LABEL}={tq}")

    def admitted():  # type: ignore[no-untyped-def]
        obj = objects.get("tenantquota", tq)
        return obj if objects.condition(obj, "Ready").get("status") == "True" else None

    obj = cluster.wait_for(admitted, timeout=90, what=f"tenantquota/{tq} Ready after the label")
    assert obj["status"]["keyCount"] == 1
