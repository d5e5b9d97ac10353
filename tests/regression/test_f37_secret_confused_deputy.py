"""Issue 28, item 3 (finding 37): the operator must not be a confused deputy for Secrets.

On 939d895 a TenantQuota with ``namespaces: [kube-system]`` and ``apiKeySecretRef`` naming a
Secret in kube-system (a bootstrap token, say) was Ready with ``keyCount: 2``: the operator read
that Secret with its own rights and published the SHA-256 of each line to every runtime, so each
line became a valid API key, and kube-system was admitted to the serving port. The only rule was
"one of the tenant's namespaces", which the TenantQuota's author chooses.

Now: system namespaces are never read (and the CRD refuses them); outside the runtime namespace a
key Secret is used only if it opts in with the label ``zerolayer.io/tenant-keys: <tenant>``; the
fleet's own key-hash Secret is never a tenant's key Secret. A refused quota is not Ready, its
keys are neither published nor counted, no policy admits its namespaces, and a warning event says why.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import yaml

from tests.regression.manifest_fixtures import CONFIG
from zerolayer.operator import validation

pytestmark = [pytest.mark.regression]
ROOT = pathlib.Path(__file__).resolve().parents[2]
LABEL = "zerolayer.io/tenant-keys"


def _quota(name: str, secret_ns: str, secret: str, namespaces: list[str], tenant: str | None = None) -> dict:
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", "metadata": {"name": name},
            "spec": {"tenant": tenant or name, "apiKeySecretRef": {"name": secret, "namespace": secret_ns},
                     "namespaces": namespaces, "tokensPerMinute": 10, "requestsPerMinute": 1}}


def _reconcile(kube, body):  # type: ignore[no-untyped-def]
    from zerolayer.operator.errors import OperatorError
    from zerolayer.operator.reconcile import Reconciler

    try:
        asyncio.run(Reconciler(kube, CONFIG).reconcile_tenant_quota(body))
    except OperatorError:
        pass  # refused (SpecError) or waiting (WaitingFor): the status says which
    status = kube.find("zerolayer.io/v1alpha1", "TenantQuota", body["metadata"]["name"]).get("status") or {}
    return status, {c["type"]: c for c in status.get("conditions", ())}


def _fake_kube():  # type: ignore[no-untyped-def]
    from tests.unit.operator.fakes import FakeKube

    kube = FakeKube()
    read: list[tuple[str, str]] = []
    check = kube.check_secret

    async def spy(namespace, name, key):  # type: ignore[no-untyped-def]
        read.append((namespace, name))
        return await check(namespace, name, key)

    kube.check_secret = spy
    return kube, read


def test_the_reported_attack_kube_system_listed_as_a_tenant_namespace_is_refused_unread():
    kube, read = _fake_kube()
    kube.secrets[("kube-system", "bootstrap-token-abcdef")] = {"api-keys": "abcdef.0123456789abcdef\nsecond\n"}
    body = kube.put(_quota("evil", "kube-system", "bootstrap-token-abcdef", ["kube-system"]))
    status, conds = _reconcile(kube, body)
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "SecretNamespaceNotAllowed"
    assert "system namespace" in conds["Ready"]["message"]
    assert status.get("keyCount") == 0 and read == []
    assert "evil" not in kube.published_tenant_keys(CONFIG.runtime_namespace)
    assert [k for k in kube.kinds("NetworkPolicy") + kube.kinds("CiliumNetworkPolicy") if "evil" in k] == []
    assert any(e[2] == "SecretNamespaceNotAllowed" and e[-1] for e in kube.events), kube.events


def test_a_secret_in_a_listed_namespace_that_does_not_opt_in_is_not_used():
    kube, read = _fake_kube()
    kube.secrets[("payments", "db-credentials")] = {"api-keys": "hunter2\n"}
    body = kube.put(_quota("grab", "payments", "db-credentials", ["payments"]))
    status, conds = _reconcile(kube, body)
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "SecretNotOptedIn"
    assert LABEL in conds["Ready"]["message"] and "hunter2" not in str(status)
    assert status.get("keyCount") == 0
    assert "grab" not in kube.published_tenant_keys(CONFIG.runtime_namespace)
    assert any(e[2] == "SecretNotOptedIn" for e in kube.events), kube.events


def test_a_secret_that_does_not_opt_in_reveals_nothing_but_its_existence():
    kube, _ = _fake_kube()
    kube.secrets[("payments", "db-credentials")] = {"other-entry": "hunter2\n"}
    body = kube.put(_quota("probe", "payments", "db-credentials", ["payments"]))
    _, conds = _reconcile(kube, body)
    assert conds["Ready"]["reason"] == "SecretNotOptedIn"  # not KeyMissing: entries stay unknown


def test_a_secret_labelled_for_another_tenant_is_not_used():
    kube, _ = _fake_kube()
    kube.secrets[("team", "acme-keys")] = {"api-keys": "sk-acme\n"}
    kube.secret_labels[("team", "acme-keys")] = {LABEL: "acme"}
    body = kube.put(_quota("thief", "team", "acme-keys", ["team"]))
    _, conds = _reconcile(kube, body)
    assert conds["Ready"]["reason"] == "SecretNotOptedIn" and "'acme'" in conds["Ready"]["message"]
    assert "thief" not in kube.published_tenant_keys(CONFIG.runtime_namespace)


def test_an_opted_in_secret_and_a_runtime_namespace_secret_are_served():
    kube, _ = _fake_kube()
    kube.secrets[("team", "acme-keys")] = {"api-keys": "sk-acme\n"}
    kube.secret_labels[("team", "acme-keys")] = {LABEL: "acme"}
    kube.secrets[(CONFIG.runtime_namespace, "globex-keys")] = {"api-keys": "sk-globex\n"}
    for body in (_quota("acme", "team", "acme-keys", ["team"]),
                 _quota("globex", CONFIG.runtime_namespace, "globex-keys", ["globex"])):
        status, conds = _reconcile(kube, kube.put(body))
        assert conds["Ready"]["status"] == "True", conds
        assert status["keyCount"] == 1
    assert set(kube.published_tenant_keys(CONFIG.runtime_namespace)) == {"acme", "globex"}


def test_the_fleets_key_hash_secret_is_never_a_tenants_key_secret():
    kube, read = _fake_kube()
    body = kube.put(_quota("loop", CONFIG.runtime_namespace, "zl-tenant-keys", ["loop"]))
    _, conds = _reconcile(kube, body)
    assert conds["Ready"]["reason"] == "SecretNotAllowed" and read == []


@pytest.mark.parametrize("namespace,labels,tenant,refused", [
    ("kube-system", {LABEL: "t"}, "t", "SecretNamespaceNotAllowed"),  # a label does not open system namespaces
    ("kube-public", {}, "t", "SecretNamespaceNotAllowed"),
    ("kube-node-lease", {}, "t", "SecretNamespaceNotAllowed"),
    ("zl-run", {}, "t", None),  # the runtime namespace: the installer's
    ("team", {}, "t", "opt-in"),
    ("team", {LABEL: "other"}, "t", "opt-in"),
    ("team", {LABEL: "t"}, "t", None),
    ("team", {"zerolayer.io/tenant": "t"}, "t", "opt-in"),  # only the documented label counts
])
def test_the_rule_as_a_table(namespace, labels, tenant, refused):
    before = validation.key_secret_namespace_problem(namespace, "keys", fleet_secret="zl-tenant-keys",
                                                     runtime_namespace="zl-run")
    after = validation.key_secret_opt_in_problem(namespace, "keys", labels, tenant=tenant, runtime_namespace="zl-run")
    if refused is None:
        assert before is None and after is None
    elif refused == "opt-in":
        assert before is None and after is not None and LABEL in after
    else:
        assert before is not None and before[0] == refused


def test_the_crd_refuses_system_namespaces_for_the_key_secret():
    crd = yaml.safe_load((ROOT / "crds" / "tenantquotas.zerolayer.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    namespace = schema["properties"]["apiKeySecretRef"]["properties"]["namespace"]
    rules = " ".join(r["rule"] for r in namespace.get("x-kubernetes-validations", ()))
    for system in validation.SYSTEM_NAMESPACES:
        assert f"'{system}'" in rules
