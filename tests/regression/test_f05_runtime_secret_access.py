"""Review finding 5: every runtime pod could read every tenant's plaintext API keys (a RoleBinding
per tenant to the runtime namespace's whole service-account group), with the token mounted in
every container, and the chart put runtimes in the operator's namespace.

Now: no runtime Role or ClusterRole grants any Secret but the fleet's key hashes; that grant is
bound to the runtime's ServiceAccount by name; the token is mounted only into the containers that
call the API (not into model downloads); the chart's runtime namespace is not the operator's.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.regression.manifest_fixtures import CONFIG, containers, daemonset, inode
from zerolayer.operator import manifests as m

pytestmark = [pytest.mark.regression]

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "zerolayer"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def tquota() -> dict:
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", "metadata": {"name": "acme", "uid": "u-2"},
            "spec": {"tenant": "acme", "apiKeySecretRef": {"name": "acme-keys", "namespace": "acme"},
                     "namespaces": ["acme"], "tokensPerMinute": 10, "requestsPerMinute": 1}}


def runtime_rbac() -> list[dict]:
    """Every Role/ClusterRole and binding the operator builds that a runtime ends up holding."""
    found = []
    for name in dir(m):
        if name.startswith("build_") and name not in ("build_daemonset", "build_model_storage"):
            builder = getattr(m, name)
            for body, prefix in ((inode(), "zl-runtime-"), (tquota(), "zl-tenant-")):
                try:
                    obj = builder(body, CONFIG)
                except (KeyError, TypeError, AttributeError):
                    continue
                if isinstance(obj, dict) and obj.get("kind") in ("Role", "ClusterRole", "RoleBinding",
                                                                  "ClusterRoleBinding") \
                        and obj["metadata"]["name"].startswith(prefix):  # a builder meant for this kind
                    found.append(obj)
    return found


def test_no_runtime_role_grants_a_tenant_secret():
    for obj in runtime_rbac():
        for rule in obj.get("rules") or ():
            if "secrets" in rule["resources"]:
                # the one Secret of key hashes, by name: read and watched (the runtime follows it by watch)
                assert rule.get("resourceNames") == [m.TENANT_KEYS_SECRET], obj["metadata"]["name"]
                assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
                assert obj["metadata"]["namespace"] == CONFIG.runtime_namespace


def test_bindings_name_the_runtime_service_account_not_a_group():
    bindings = [o for o in runtime_rbac() if o["kind"].endswith("Binding")]
    assert bindings
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": m.runtime_name("gpu-0"),
                                        "namespace": CONFIG.runtime_namespace}], binding["metadata"]["name"]


def test_token_only_in_containers_that_call_the_api():
    ds = daemonset(inode(models=[{"name": "hf", "source": {"huggingFace": {"repo": "org/model"}}}]))
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    token_volumes = {v["name"] for v in pod["volumes"] if any("serviceAccountToken" in s
                                                            for s in (v.get("projected") or {}).get("sources", ()))}
    assert token_volumes

    def has_token(container: dict) -> bool:
        return any(v["name"] in token_volumes and v["mountPath"] == TOKEN_DIR for v in container.get("volumeMounts", ()))

    assert [c["name"] for c in pod["initContainers"] if has_token(c)] == []  # model downloads: no token
    assert {name for name, c in containers(ds).items() if has_token(c)} == set(containers(ds))


def test_chart_runtime_namespace_is_not_the_release_namespace_by_default():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    definition = re.search(r'define "zerolayer.runtimeNamespace".*?end -}}', helpers, re.S).group(0)
    assert "default .Release.Namespace" not in definition
