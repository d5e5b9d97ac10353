"""In-cluster mode: API objects -> config and tenants (pure), and the sync loop over a reader double."""

from __future__ import annotations

import base64

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.config import parse_config
from zerolayer.runtime.incluster import TenantSync, config_from_inferencenode, tenants_from_quotas
from zerolayer.runtime.tenants import key_hash

def inode(**spec):  # type: ignore[no-untyped-def]
    return {"metadata": {"name": "gpu-1"}, "spec": {"nodeName": "gpu-1", **spec}}


def quota(name, secret="keys", **spec):  # type: ignore[no-untyped-def]
    base = {"tenant": name, "apiKeySecretRef": {"name": secret}, "namespaces": ["team"],
            "tokensPerMinute": 1000, "requestsPerMinute": 10}
    return {"metadata": {"name": name}, "spec": {**base, **spec}}


def secret(*keys: str, entry: str = "api-keys"):  # type: ignore[no-untyped-def]
    return {"data": {entry: base64.b64encode("\n".join(keys).encode()).decode()}}


def test_inferencenode_becomes_a_valid_config():
    node = inode(models=[{"name": "small", "source": "/models/s"}, {"name": "big", "source": "/models/b",
                                                                      "default": True, "maxModelLen": 4096}],
                 runtime={"engine": "vllm", "port": 9443, "kvCacheBytes": 1 << 28, "drainSeconds": 60},
                 scheduler={"memoryThreshold": 0.9, "normalThreshold": 0.96, "resumeThreshold": 0.85,
                            "sampleIntervalMs": 100})
    mapping = config_from_inferencenode(node)
    assert mapping["engine"] == {"kind": "vllm", "model_path": "/models/b", "served_name": "big",
                                 "max_model_len": 4096, "kv_cache_memory_bytes": 1 << 28}
    assert mapping["listen"] == {"host": "0.0.0.0", "port": 9443}
    assert mapping["scheduler"]["low_shed_at"] == 0.9 and mapping["scheduler"]["normal_resume_below"] == pytest.approx(0.91)
    config = parse_config(mapping, base_dir=None, environ={})  # type: ignore[arg-type]
    assert config.sample_interval_s == 0.1 and config.limits.drain_timeout_s == 60


def test_synthetic_node_serves_every_model_name():
    mapping = config_from_inferencenode(inode(models=[{"name": "a", "source": "x"}, {"name": "b", "source": "y"}],
                                              runtime={"engine": "synthetic"}))
    assert mapping["engine"] == {"kind": "synthetic", "models": ["a", "b"]}


def test_quotas_and_secrets_become_tenants():
    quotas = [quota("acme", allowedPriorities=["high", "normal"], allowedModels=["big"]),
              quota("globex", secret="gx", maxConcurrentStreams=5),
              quota("nokeys", secret="missing")]
    secrets = {("zerolayer", "keys"): secret("sk-1", "sk-2", ""), ("zerolayer", "gx"): secret("sk-g")}
    tenants = {t.name: t for t in tenants_from_quotas(quotas, secrets, "zerolayer")}
    assert set(tenants) == {"acme", "globex"}  # no keys, no tenant
    assert tenants["acme"].key_hashes == {key_hash("sk-1"), key_hash("sk-2")}
    assert tenants["acme"].policy.allowed_priorities == {Priority.HIGH, Priority.NORMAL}
    assert tenants["acme"].policy.allowed_models == {"big"}
    assert tenants["globex"].policy.allowed_priorities == {Priority.NORMAL, Priority.LOW}  # CRD default
    assert tenants["globex"].policy.max_concurrent_streams == 5
    assert tenants["globex"].policy.tokens_per_minute == 1000


class FakeReader:
    """Test double of KubeReader (our own wrapper), holding API objects in memory."""

    def __init__(self) -> None:
        self.quotas = [quota("acme")]
        self.secrets = {("zerolayer", "keys"): secret("sk-old")}

    def tenant_quotas(self):  # type: ignore[no-untyped-def]
        return list(self.quotas)

    def secret(self, namespace, name):  # type: ignore[no-untyped-def]
        return self.secrets.get((namespace, name))


@pytest.mark.asyncio(loop_scope="session")
async def test_sync_applies_only_changes():
    reader, applied = FakeReader(), []
    sync = TenantSync(reader, applied.append, namespace="zerolayer")
    assert await sync.sync_once() is True
    assert await sync.sync_once() is False  # nothing changed: nothing applied
    reader.secrets[("zerolayer", "keys")] = secret("sk-new")  # key rotation
    assert await sync.sync_once() is True
    assert applied[-1][0].key_hashes == {key_hash("sk-new")}
    reader.quotas = []
    assert await sync.sync_once() is True and applied[-1] == []
