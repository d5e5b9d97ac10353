"""Review finding 3: one TenantQuota whose Secret the runtime could not read (403) froze tenant
sync for every tenant, and a runtime that restarted exited at its first sync.

Runtimes no longer read tenants' Secrets at all: the operator publishes key hashes into one
Secret per fleet, and a Secret it cannot read (403 or 404) costs that tenant only, with a
condition on its TenantQuota. A first sync that fails does not end the runtime.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.regression.incluster_fakes import Reader, quota, sha
from zerolayer.runtime.node.incluster import TenantSync
from zerolayer.runtime.tenants import TenantDirectory

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]


def who(directory: TenantDirectory, key: str) -> str | None:
    tenant = directory.authenticate({"x-api-key": key})
    return tenant.name if tenant else None


@pytest.mark.asyncio(loop_scope="session")
async def test_one_forbidden_secret_does_not_freeze_the_other_tenants():
    reader = Reader([quota("acme"), quota("globex")], {"acme-keys": ["sk-acme-old"], "globex-keys": ["sk-globex"]})
    directory = TenantDirectory()
    sync = TenantSync(reader, directory.replace, namespace="zerolayer")
    await sync.sync_once()
    assert who(directory, "sk-acme-old") == "acme" and who(directory, "sk-globex") == "globex"

    # An admin adds a quota whose Secret name is mistyped: the runtime's account gets 403 for it.
    reader.quotas.append(quota("typo", secret="no-such-keys"))
    reader.forbidden.add("no-such-keys")
    reader.keys["acme-keys"] = ["sk-acme-new"]  # acme rotates (revokes) its key
    reader.quotas = [q for q in reader.quotas if q["metadata"]["name"] != "globex"]  # globex is removed
    await sync.sync_once()
    assert who(directory, "sk-acme-old") is None, "a revoked key is still accepted"
    assert who(directory, "sk-acme-new") == "acme"
    assert who(directory, "sk-globex") is None, "a removed tenant is still served"


class _Probe:
    def emit(self, *event) -> None:  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass


def test_runtime_with_one_forbidden_secret_starts_and_serves_the_healthy_tenants(monkeypatch):
    from zerolayer.runtime import cli
    from zerolayer.runtime.node import incluster
    from zerolayer.runtime.node import agent as node_agent
    from zerolayer.runtime.serving.server import RuntimeServer
    from zerolayer.bpf import hook as audit_hook

    reader = Reader([quota("acme"), quota("typo", secret="no-such-keys")], {"acme-keys": ["sk-acme"]})
    reader.forbidden.add("no-such-keys")
    reader.inference_node = lambda name: {"metadata": {"name": name}, "spec": {
        "nodeName": "gpu-1", "runtime": {"engine": "synthetic", "port": 0},
        "models": [{"name": "m", "source": {"path": "/none"}}]}}
    monkeypatch.setattr(incluster, "KubeReader", lambda *a, **k: reader)

    async def no_gossip(self, server):  # type: ignore[no-untyped-def]
        return self

    monkeypatch.setattr(node_agent.NodeAgent, "start", no_gossip)
    monkeypatch.setattr(audit_hook, "open_token_probe", lambda args: _Probe())
    served: dict = {}

    async def serve_forever(self):  # type: ignore[no-untyped-def]
        served["acme"] = who(self.tenants, "sk-acme")
        await self.stop()

    monkeypatch.setattr(RuntimeServer, "serve_forever", serve_forever)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["runtime", "--node-name", "gpu-1", "--port", "0", "--tenant-namespace", "zerolayer"])
    assert cli.run(args) == 0, "the runtime exited at its first tenant sync"
    assert served == {"acme": "acme"}


def test_operator_reports_an_unreadable_secret_and_publishes_the_others(tmp_path):
    from tests.unit.operator.fakes import FakeKube
    from zerolayer.operator.config import OperatorConfig
    from zerolayer.operator.errors import KubeError
    from zerolayer.operator.reconcile import Reconciler, WaitingFor

    kube = FakeKube()
    kube.secrets[("team", "acme-keys")] = {"api-keys": "sk-acme\n"}
    kube.secret_labels[("team", "acme-keys")] = {"zerolayer.io/tenant-keys": "acme"}  # opted in (issue 28)
    forbidden = {("team", "no-such-keys")}
    check = kube.check_secret

    async def check_secret(namespace, name, key):  # type: ignore[no-untyped-def]
        if (namespace, name) in forbidden:
            raise KubeError(f"GET /api/v1/namespaces/{namespace}/secrets/{name}: 403 Forbidden", status=403,
                            reason="Forbidden")
        return await check(namespace, name, key)

    kube.check_secret = check_secret
    reconciler = Reconciler(kube, OperatorConfig(runtime_namespace="zerolayer"))
    good = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", **quota("acme")})
    bad = kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
                    **quota("typo", secret="no-such-keys")})
    asyncio.run(reconciler.reconcile_tenant_quota(good))
    with pytest.raises(WaitingFor):
        asyncio.run(reconciler.reconcile_tenant_quota(bad))
    conditions = {c["type"]: c for c in kube.find("zerolayer.io/v1alpha1", "TenantQuota", "typo")["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "SecretUnreadable"
    assert "no-such-keys" in conditions["Ready"]["message"]
    published = kube.published_tenant_keys("zerolayer")
    assert set(published) == {"acme"} and published["acme"]["hashes"] == [sha("sk-acme")]
