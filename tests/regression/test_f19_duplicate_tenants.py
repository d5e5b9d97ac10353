"""Review finding 19: two TenantQuotas with the same ``spec.tenant``, or the same key in two
tenants' Secrets, merged silently (last one wins): requests could be billed to the wrong
tenant. Now the older quota keeps the name and the key; the newer one is refused and reported."""

from __future__ import annotations

import asyncio

import pytest

from tests.regression.incluster_fakes import Reader, quota
from zerolayer.runtime.node.incluster import TenantSync
from zerolayer.runtime.tenants import TenantDirectory

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]


def who(directory: TenantDirectory, key: str) -> str | None:
    tenant = directory.authenticate({"x-api-key": key})
    return tenant.name if tenant else None


@pytest.mark.asyncio(loop_scope="session")
async def test_a_key_in_two_tenants_stays_with_the_older_quota():
    reader = Reader([quota("acme", created="2026-01-01T00:00:00Z"), quota("globex", created="2026-02-01T00:00:00Z")],
                    {"acme-keys": ["sk-shared", "sk-acme"], "globex-keys": ["sk-globex", "sk-shared"]})
    directory = TenantDirectory()
    sync = TenantSync(reader, directory.replace, namespace="zerolayer")
    await sync.sync_once()
    assert who(directory, "sk-shared") == "acme"
    assert who(directory, "sk-globex") is None, "the newer quota sharing a key must be refused whole"
    assert "globex" in sync.problems and "acme" in sync.problems["globex"]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_second_quota_for_the_same_tenant_is_refused():
    reader = Reader([quota("acme", created="2026-01-01T00:00:00Z"),
                     quota("acme-copy", tenant="acme", created="2026-03-01T00:00:00Z", tokensPerMinute=10**9)],
                    {"acme-keys": ["sk-acme"], "acme-copy-keys": ["sk-other"]})
    directory = TenantDirectory()
    sync = TenantSync(reader, directory.replace, namespace="zerolayer")
    await sync.sync_once()
    assert who(directory, "sk-other") is None
    assert directory.policies()["acme"].tokens_per_minute == 100000  # the older quota's policy, not merged
    assert "acme-copy" in sync.problems


def test_operator_refuses_the_newer_duplicate_with_a_condition():
    from tests.unit.operator.fakes import FakeKube
    from zerolayer.operator.config import OperatorConfig
    from zerolayer.operator.errors import SpecError
    from zerolayer.operator.reconcile import Reconciler, WaitingFor

    kube = FakeKube()
    kube.secrets[("team", "acme-keys")] = {"api-keys": "sk-shared\n"}
    kube.secrets[("team", "globex-keys")] = {"api-keys": "sk-globex\nsk-shared\n"}
    kube.secrets[("team", "copy-keys")] = {"api-keys": "sk-copy\n"}
    for secret, tenant in (("acme-keys", "acme"), ("globex-keys", "globex"), ("copy-keys", "acme")):
        kube.secret_labels[("team", secret)] = {"zerolayer.io/tenant-keys": tenant}  # opted in (issue 28)
    reconciler = Reconciler(kube, OperatorConfig(runtime_namespace="zerolayer"))

    def put(q):  # type: ignore[no-untyped-def]
        return kube.put({"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", **q})

    acme = put(quota("acme", created="2026-01-01T00:00:00Z"))
    globex = put(quota("globex", created="2026-02-01T00:00:00Z"))
    copy = put(quota("copy", tenant="acme", created="2026-03-01T00:00:00Z"))
    asyncio.run(reconciler.reconcile_tenant_quota(acme))
    for body, reason in ((globex, "DuplicateKey"), (copy, "DuplicateTenant")):
        with pytest.raises((WaitingFor, SpecError)):
            asyncio.run(reconciler.reconcile_tenant_quota(body))
        name = body["metadata"]["name"]
        ready = {c["type"]: c for c in kube.find("zerolayer.io/v1alpha1", "TenantQuota", name)["status"]["conditions"]}
        assert ready["Ready"]["reason"] == reason and "acme" in ready["Ready"]["message"]
    assert set(kube.published_tenant_keys("zerolayer")) == {"acme"}
    # The kept quota is told too.
    assert any(e[1] == "acme" and e[2] in ("DuplicateKey", "DuplicateTenant") for e in kube.events)
