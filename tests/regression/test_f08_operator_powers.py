"""Review finding 8: whoever could write InferenceNodes chose the image of the root, BPF- and
ptrace-capable auditor (and of defragd and the root model downloads); whoever could write
TenantQuotas could point apiKeySecretRef at any namespace's Secret; the operator held list/watch on
every Secret for nothing.

Now: only the server follows ``spec.runtime.image``; the privileged containers run the operator's
configured image. apiKeySecretRef must name one of the tenant's namespaces, the runtime namespace or
an allow-listed one. The operator's Secret access is ``get`` only.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.regression.manifest_fixtures import CONFIG, containers, daemonset, inode
from zerolayer.operator import rbac

pytestmark = [pytest.mark.regression]


def test_only_the_server_follows_spec_runtime_image():
    ds = daemonset(inode(runtime={"image": "attacker/img:1"},
                         models=[{"name": "hf", "source": {"huggingFace": {"repo": "org/model"}}}]))
    c = containers(ds)
    assert c["server"]["image"] == "attacker/img:1"
    others = [x for x in ds["spec"]["template"]["spec"]["containers"] + ds["spec"]["template"]["spec"]["initContainers"]
              if x["name"] != "server"]
    assert {x["name"] for x in others} >= {"auditor", "fetch-model-0"}
    for container in others:
        assert container["image"] == CONFIG.runtime_image, container["name"]


def test_operator_holds_no_list_or_watch_on_secrets():
    # list/watch only on the fleet's key-hash Secret, by name: runtimes watch it, and RBAC lets the
    # operator grant only what it holds. Never on tenants' Secrets.
    for rule in rbac.CLUSTER_RULES + rbac.RUNTIME_NAMESPACE_RULES:
        if "secrets" in rule["resources"] and {"list", "watch"} & set(rule["verbs"]):
            assert rule.get("resourceNames") == [rbac.TENANT_KEYS_SECRET], rule


def test_api_key_secret_in_a_foreign_namespace_is_refused_and_not_read():
    from tests.unit.operator.fakes import FakeKube
    from zerolayer.operator.errors import OperatorError
    from zerolayer.operator.reconcile import Reconciler

    kube = FakeKube()
    kube.secrets[("kube-system", "bootstrap-token")] = {"api-keys": "not-a-key\n"}
    read = []
    check = kube.check_secret

    async def spy(namespace, name, key):  # type: ignore[no-untyped-def]
        read.append((namespace, name))
        return await check(namespace, name, key)

    kube.check_secret = spy
    body = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", "metadata": {"name": "evil"},
                     "spec": {"tenant": "evil", "apiKeySecretRef": {"name": "bootstrap-token",
                                                                     "namespace": "kube-system"},
                              "namespaces": ["team-evil"], "tokensPerMinute": 10, "requestsPerMinute": 1}})
    with pytest.raises(OperatorError):
        asyncio.run(Reconciler(kube, CONFIG).reconcile_tenant_quota(body))
    status = kube.find("zerolayer.io/v1alpha1", "TenantQuota", "evil").get("status") or {}
    ready = {c["type"]: c for c in status.get("conditions", ())}.get("Ready", {})
    assert ready.get("status") == "False" and ready.get("reason") == "SecretNamespaceNotAllowed"
    assert read == [] and kube.kinds("Role") == [] and kube.kinds("RoleBinding") == []
