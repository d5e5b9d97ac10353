"""In-cluster mode: API objects -> config and tenants (pure), and the sync loop over a reader double."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.config import parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.incluster import TenantSync, config_from_inferencenode, published_entries, tenants_from_quotas
from zerolayer.runtime.tenants import key_hash

def inode(**spec):  # type: ignore[no-untyped-def]
    return {"metadata": {"name": "gpu-1"}, "spec": {"nodeName": "gpu-1", **spec}}


def quota(name, secret="keys", **spec):  # type: ignore[no-untyped-def]
    base = {"tenant": name, "apiKeySecretRef": {"name": secret}, "namespaces": ["team"],
            "tokensPerMinute": 1000, "requestsPerMinute": 10}
    return {"metadata": {"name": name}, "spec": {**base, **spec}}


def published(**keys):  # type: ignore[no-untyped-def]
    """The operator's published entries (runtime/node/incluster.py published_entries), by TenantQuota name."""
    return {name: {"tenant": name, "created": "", "hashes": frozenset(key_hash(k) for k in ks)}
            for name, ks in keys.items()}


def test_inferencenode_becomes_a_valid_config():
    node = inode(models=[{"name": "small", "source": "/models/s"}, {"name": "big", "source": "/models/b",
                                                                      "default": True, "maxModelLen": 4096}],
                 runtime={"engine": "vllm", "port": 9443, "kvCacheBytes": 1 << 28, "drainSeconds": 60},
                 scheduler={"memoryThreshold": 0.9, "normalThreshold": 0.96, "resumeThreshold": 0.85,
                            "sampleIntervalMs": 100})
    mapping = config_from_inferencenode(node)
    # Every model is served, one engine each, the default first; both share the pod's one GPU.
    assert mapping["engines"] == [
        {"kind": "vllm", "model_path": "/models/b", "served_name": "big", "max_model_len": 4096,
         "kv_cache_memory_bytes": 1 << 28, "gpus": [0], "tensor_parallel_size": 1},
        {"kind": "vllm", "model_path": "/models/s", "served_name": "small",
         "kv_cache_memory_bytes": 1 << 28, "gpus": [0], "tensor_parallel_size": 1}]
    assert "engine" not in mapping
    assert mapping["gpu"] == {"source": "auto", "kv_cache_bytes": 1 << 28}
    assert mapping["listen"] == {"host": "0.0.0.0", "port": 9443}
    assert mapping["scheduler"]["low_shed_at"] == 0.9 and mapping["scheduler"]["normal_resume_below"] == pytest.approx(0.91)
    config = parse_config(mapping, base_dir=None, environ={})  # type: ignore[arg-type]
    assert config.sample_interval_s == 0.1 and config.limits.drain_timeout_s == 60


def test_models_get_their_own_gpus_and_share_the_rest():
    models = [{"name": "a", "source": "/w/a", "gpus": 2}, {"name": "b", "source": "/w/b", "default": True},
              {"name": "c", "source": "/w/c"}]
    mapping = config_from_inferencenode(inode(models=models, runtime={"engine": "vllm", "gpus": 4}))
    by_name = {e["served_name"]: e for e in mapping["engines"]}
    assert [e["served_name"] for e in mapping["engines"]] == ["b", "a", "c"]  # the default answers unnamed requests
    assert by_name["a"]["gpus"] == [0, 1] and by_name["a"]["tensor_parallel_size"] == 2
    assert "gpu_memory_utilization" not in by_name["a"]  # alone on its GPUs: vLLM's default fraction
    for shared in ("b", "c"):  # the two left over, shared: half the memory fraction each
        assert by_name[shared]["gpus"] == [2, 3] and by_name[shared]["tensor_parallel_size"] == 2
        assert by_name[shared]["gpu_memory_utilization"] == 0.45
    config = parse_config(mapping, base_dir=None, environ={})  # type: ignore[arg-type]
    assert [e["served_name"] for e in config.engines] == ["b", "a", "c"]


def test_models_that_take_every_gpu_leave_none_to_share():
    models = [{"name": "a", "source": "/w/a", "gpus": 1}, {"name": "b", "source": "/w/b"}]
    with pytest.raises(ConfigError, match="no GPU is left for b"):
        config_from_inferencenode(inode(models=models, runtime={"engine": "vllm", "gpus": 1}))


def test_adapters_and_the_tool_parser_reach_the_engine():
    model = {"name": "m", "source": {"hostPath": {"path": "/w/m"}}, "toolCallParser": "hermes",
             "loras": [{"name": "m-sql", "source": {"pvc": {"claimName": "adapters", "subPath": "sql"}}},
                       {"name": "m-chat", "source": {"path": "/baked/chat"}}]}
    engine = config_from_inferencenode(inode(models=[model], runtime={"engine": "vllm"}))["engine"]
    assert engine["tool_parser"] == "hermes"
    assert engine["loras"] == [{"name": "m-sql", "path": "/models/m-sql"}, {"name": "m-chat", "path": "/baked/chat"}]


def test_synthetic_node_serves_every_model_name():
    mapping = config_from_inferencenode(inode(models=[{"name": "a", "source": "x"}, {"name": "b", "source": "y"}],
                                              runtime={"engine": "synthetic"}))
    assert mapping["engine"] == {"kind": "synthetic", "models": ["a", "b"]}


def test_quotas_and_published_hashes_become_tenants():
    quotas = [quota("acme", allowedPriorities=["high", "normal"], allowedModels=["big"]),
              quota("globex", secret="gx", maxConcurrentStreams=5),
              quota("nokeys", secret="missing")]
    view = tenants_from_quotas(quotas, published(acme=["sk-1", "sk-2"], globex=["sk-g"]))
    tenants = {t.name: t for t in view.tenants}
    assert set(tenants) == {"acme", "globex"}  # no keys, no tenant
    assert set(view.problems) == {"nokeys"}
    assert tenants["acme"].key_hashes == {key_hash("sk-1"), key_hash("sk-2")}
    assert tenants["acme"].policy.allowed_priorities == {Priority.HIGH, Priority.NORMAL}
    assert tenants["acme"].policy.allowed_models == {"big"}
    assert tenants["globex"].policy.allowed_priorities == {Priority.NORMAL, Priority.LOW}  # CRD default
    assert tenants["globex"].policy.max_concurrent_streams == 5
    assert tenants["globex"].policy.tokens_per_minute == 1000


def test_a_published_entry_that_does_not_decode_serves_nobody():
    good = base64.b64encode(b'{"tenant": "acme", "hashes": ["' + b"a" * 64 + b'"]}').decode()
    bad = base64.b64encode(b'{"tenant": "globex", "hashes": ["sk-plaintext-key"]}').decode()
    entries = published_entries({"data": {"acme": good, "globex": bad, "junk": "!!"}})
    assert set(entries) == {"acme"} and entries["acme"]["hashes"] == {"a" * 64}


class FakeReader:
    """Test double of KubeReader (our own wrapper), holding API objects in memory."""

    def __init__(self) -> None:
        self.quotas = [quota("acme")]
        self.keys = published(acme=["sk-old"])

    def tenant_quotas(self):  # type: ignore[no-untyped-def]
        return list(self.quotas)

    def tenant_keys(self, namespace):  # type: ignore[no-untyped-def]
        assert namespace == "zerolayer"
        return dict(self.keys)


@pytest.mark.asyncio(loop_scope="session")
async def test_sync_applies_only_changes():
    reader, applied = FakeReader(), []
    sync = TenantSync(reader, applied.append, namespace="zerolayer")
    assert await sync.sync_once() is True
    assert await sync.sync_once() is False  # nothing changed: nothing applied
    reader.keys = published(acme=["sk-new"])  # key rotation
    assert await sync.sync_once() is True
    assert applied[-1][0].key_hashes == {key_hash("sk-new")}
    reader.quotas = []
    assert await sync.sync_once() is True and applied[-1] == []


class FakeWatch:
    """What TenantSync/NodeSpecSync use of kubewatch.WatchLoop: ``objects``, ``started``, ``counters``."""

    def __init__(self, on_change) -> None:  # type: ignore[no-untyped-def]
        import threading

        from zerolayer.kubewatch import WatchCounters

        self.on_change, self.objects, self.counters = on_change, {}, WatchCounters()
        self.started = threading.Event()
        self.stopped = False

    def start(self):  # type: ignore[no-untyped-def]
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True

    def change(self, objects) -> None:  # type: ignore[no-untyped-def]
        """An event arrived (called from the watch thread in real life)."""
        self.objects = dict(objects)
        self.started.set()
        self.on_change()


class WatchingReader:
    def __init__(self) -> None:
        self.watches: dict[str, FakeWatch] = {}

    def watch_tenant_quotas(self, on_change, *, retry_s):  # type: ignore[no-untyped-def]
        self.watches["quotas"] = FakeWatch(on_change)
        return self.watches["quotas"]

    def watch_tenant_keys(self, namespace, on_change, *, retry_s):  # type: ignore[no-untyped-def]
        self.watches["keys"] = FakeWatch(on_change)
        return self.watches["keys"]


def keys_secret(**tenants):  # type: ignore[no-untyped-def]
    import base64

    return {"metadata": {"name": "zl-tenant-keys"},
            "data": {name: base64.b64encode(json.dumps({"tenant": name, "created": "", "hashes": [
                key_hash(k) for k in keys]}).encode()).decode() for name, keys in tenants.items()}}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio(loop_scope="session")
async def test_watch_events_apply_tenants_without_reads():
    reader, applied = WatchingReader(), []
    sync = TenantSync(reader, applied.append, namespace="zerolayer").start()
    try:
        quotas, keys = reader.watches["quotas"], reader.watches["keys"]
        quotas.change({"acme": quota("acme")})
        await settle()
        assert applied == []  # the key hashes have not been listed yet: nothing to decide on
        keys.change({"zerolayer/zl-tenant-keys": keys_secret(acme=["sk-old"])})
        await settle()
        assert [t.name for t in applied[-1]] == ["acme"]
        status_only = dict(quota("acme"), status={"usage": {"tokensThisWindow": 5}})
        quotas.change({"acme": status_only})  # an auditor's usage write
        await settle()
        assert len(applied) == 1  # same tenants: nothing applied
        keys.change({"zerolayer/zl-tenant-keys": keys_secret(acme=["sk-new"])})  # rotation
        await settle()
        assert applied[-1][0].key_hashes == {key_hash("sk-new")}
        quotas.change({})  # the TenantQuota was deleted
        await settle()
        assert applied[-1] == []
    finally:
        await sync.stop()
    assert reader.watches["quotas"].stopped and reader.watches["keys"].stopped


class NodeReader:
    def __init__(self) -> None:
        self.watch: FakeWatch | None = None

    def watch_inference_node(self, node, on_change, *, retry_s):  # type: ignore[no-untyped-def]
        self.watch = FakeWatch(on_change)
        return self.watch


def marked_node(generation: int, memory: float) -> dict:
    return {"metadata": {"name": "gpu-1", "generation": generation},
            "spec": {"nodeName": "gpu-1", "models": [{"name": "m", "source": "/m"}],
                     "runtime": {"engine": "synthetic"},
                     "scheduler": {"memoryThreshold": memory, "resumeThreshold": 0.5}}}


@pytest.mark.asyncio(loop_scope="session")
async def test_node_spec_edits_arrive_by_watch_and_heartbeats_are_skipped():
    from zerolayer.runtime.node.incluster import NodeSpecSync

    reader, applied = NodeReader(), []
    sync = NodeSpecSync(reader, "gpu-1", {}, applied.append)
    sync.prime(marked_node(1, 0.9))
    sync.start()
    try:
        assert reader.watch is not None
        heartbeat = dict(marked_node(1, 0.9), status={"lastHeartbeat": "2026-12-03T12:00:00Z"})
        reader.watch.change({"gpu-1": heartbeat})
        await settle()
        assert applied == []  # same generation: a status update, nothing re-derived
        reader.watch.change({"gpu-1": marked_node(2, 0.8)})  # an edit
        await settle()
        assert applied and applied[-1]["low_shed_at"] == 0.8
    finally:
        await sync.stop()
