"""In-cluster mode: the node's InferenceNode says what to serve; TenantQuotas and their Secrets say who.

Pure builders turn API objects into the same config mapping the standalone file uses
(:func:`config_from_inferencenode`) and into tenants (:func:`tenants_from_quotas`).
:class:`KubeReader` is the only place this mode calls the Kubernetes API (blocking client,
always run in a thread). :class:`TenantSync` polls TenantQuotas and the Secrets they name
and applies changes to a running server without a restart (``RuntimeServer.replace_tenants``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from typing import Any, Callable, Mapping, Sequence

from zerolayer import models as model_layout
from zerolayer.contract import Priority
from zerolayer.runtime.errors import ConfigError, RuntimeServerError
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.tenants import Tenant, key_hash

log = logging.getLogger(__name__)

GROUP, VERSION = "zerolayer.io", "v1alpha1"
DEFAULT_SECRET_KEY = "api-keys"
DEFAULT_PRIORITIES = ("normal", "low")  # the CRD's default
DEFAULT_MAX_STREAMS = 64
# Where the operator mounts the tlsSecretName Secret (operator/manifests.py TLS_MOUNT).
TLS_DIR = "/etc/zerolayer/tls"


class ClusterReadError(RuntimeServerError):
    """The Kubernetes API could not be read (the previous tenants stay in force)."""


# --------------------------------------------------------------------------- pure builders
def config_from_inferencenode(inode: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The standalone-config mapping for this node, from its InferenceNode (``base`` fills the rest).

    The engine serves one model: the one marked ``default``, else the first, loaded from the
    path where the operator mounts its source (:func:`zerolayer.models.container_path`). The
    scheduler's thresholds map onto its shedding marks; ``sampleIntervalMs`` onto the telemetry
    period. ``tlsSecretName`` turns on TLS with the certificate the operator mounts at
    :data:`TLS_DIR` (the probes then use HTTPS).
    """
    spec = inode.get("spec") or {}
    config: dict[str, Any] = {k: v for k, v in (base or {}).items()}
    runtime = spec.get("runtime") or {}
    models = spec.get("models") or []
    if not models:
        raise ConfigError(f"InferenceNode {inode.get('metadata', {}).get('name')}: spec.models is empty")
    model = next((m for m in models if m.get("default")), models[0])
    kind = runtime.get("engine", "vllm")
    if kind == "synthetic":
        engine: dict[str, Any] = {"kind": "synthetic", "models": [m["name"] for m in models]}
    else:
        try:
            path = model_layout.container_path(model)
        except model_layout.ModelSourceError as exc:
            raise ConfigError(f"InferenceNode model {model.get('name')!r}: {exc}") from exc
        engine = {"kind": "vllm", "model_path": path, "served_name": model["name"]}
        if model.get("maxModelLen"):
            engine["max_model_len"] = int(model["maxModelLen"])
        if runtime.get("kvCacheBytes"):
            engine["kv_cache_memory_bytes"] = int(runtime["kvCacheBytes"])
        if runtime.get("gpuMemoryUtilization"):
            engine["engine_args"] = {"gpu_memory_utilization": float(runtime["gpuMemoryUtilization"])}
    config["engine"] = engine
    listen = dict(config.get("listen") or {})
    listen.setdefault("host", "0.0.0.0")  # a pod serves on its own IP
    listen["port"] = int(runtime.get("port", 8443))
    config["listen"] = listen
    if runtime.get("tlsSecretName"):
        config["tls"] = {"cert": f"{TLS_DIR}/tls.crt", "key": f"{TLS_DIR}/tls.key"}
    scheduler = spec.get("scheduler") or {}
    marks = dict(config.get("scheduler") or {})
    for ours, theirs in (("low_shed_at", "memoryThreshold"), ("normal_shed_at", "normalThreshold"),
                         ("low_resume_below", "resumeThreshold"), ("max_preemptions_per_tick",
                                                                    "maxPreemptionsPerTick")):
        if theirs in scheduler:
            marks[ours] = scheduler[theirs]
    if "resumeThreshold" in scheduler and "normalThreshold" in scheduler:
        # One resume mark in the CRD: normal resumes the same distance below its own mark as low does.
        gap = float(scheduler.get("memoryThreshold", 0.92)) - float(scheduler["resumeThreshold"])
        marks["normal_resume_below"] = float(scheduler["normalThreshold"]) - gap
    config["scheduler"] = marks
    if "sampleIntervalMs" in scheduler:
        config["telemetry"] = {**(config.get("telemetry") or {}), "sample_interval_ms": scheduler["sampleIntervalMs"]}
    limits = dict(config.get("limits") or {})
    if "drainSeconds" in runtime:
        limits["drain_timeout_s"] = max(1, int(runtime["drainSeconds"]))
    if limits:
        config["limits"] = limits
    return config


def secret_key_hashes(secret: Mapping[str, Any], entry: str) -> frozenset[str]:
    """SHA-256 hashes of the keys in one data entry (one key per line); values are not kept."""
    raw = (secret.get("data") or {}).get(entry)
    if raw is None:
        text = (secret.get("stringData") or {}).get(entry)
        if text is None:
            return frozenset()
    else:
        try:
            text = base64.b64decode(raw).decode()
        except (binascii.Error, UnicodeDecodeError):
            return frozenset()
    return frozenset(key_hash(line.strip()) for line in text.splitlines() if line.strip())


def secret_ref(quota: Mapping[str, Any], default_namespace: str) -> tuple[str, str, str]:
    ref = (quota.get("spec") or {}).get("apiKeySecretRef") or {}
    return ref.get("namespace") or default_namespace, ref.get("name", ""), ref.get("key") or DEFAULT_SECRET_KEY


def tenants_from_quotas(
    quotas: Sequence[Mapping[str, Any]],
    secrets: Mapping[tuple[str, str], Mapping[str, Any]],
    default_namespace: str,
) -> list[Tenant]:
    """Tenants with their key hashes and policies. A quota whose Secret (or key entry) is
    missing yields no tenant: nobody can authenticate as it until the keys exist."""
    tenants = []
    for quota in quotas:
        spec = quota.get("spec") or {}
        name = spec.get("tenant")
        namespace, secret_name, entry = secret_ref(quota, default_namespace)
        secret = secrets.get((namespace, secret_name))
        hashes = secret_key_hashes(secret, entry) if secret is not None else frozenset()
        if not name or not hashes:
            log.warning("TenantQuota %s: no usable keys in Secret %s/%s entry %s; tenant not served",
                        (quota.get("metadata") or {}).get("name"), namespace, secret_name, entry)
            continue
        models = spec.get("allowedModels")
        policy = TenantPolicy(
            tenant=name,
            tokens_per_minute=spec.get("tokensPerMinute"),
            requests_per_minute=spec.get("requestsPerMinute"),
            max_concurrent_streams=spec.get("maxConcurrentStreams", DEFAULT_MAX_STREAMS),
            allowed_priorities=frozenset(Priority.parse(p) for p in spec.get("allowedPriorities",
                                                                            DEFAULT_PRIORITIES)),
            allowed_models=frozenset(models) if models else None,
        )
        tenants.append(Tenant(name, hashes, policy))
    return tenants


def fingerprint(tenants: Sequence[Tenant]) -> str:
    """Changes only when who may call, or with what limits, changes."""
    parts = sorted(f"{t.name}|{sorted(t.key_hashes)}|{t.policy!r}" for t in tenants)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# --------------------------------------------------------------------------- API access
class KubeReader:
    """Every Kubernetes call of in-cluster mode. Blocking: call from a thread."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        try:
            from kubernetes import client, config
        except ImportError as exc:  # pragma: no cover - kubernetes is a base dependency
            raise ClusterReadError("the kubernetes client is not installed") from exc
        try:
            if kubeconfig:
                api = config.new_client_from_config(config_file=kubeconfig)
            else:
                try:
                    config.load_incluster_config()
                    api = client.ApiClient()
                except config.ConfigException:
                    api = config.new_client_from_config()
        except Exception as exc:  # ConfigException, missing files, bad YAML
            raise ClusterReadError(f"no usable Kubernetes configuration: {exc}") from exc
        self._custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise ClusterReadError(f"{what}: HTTP {exc.status} {exc.reason}") from exc
        except (HTTPError, OSError) as exc:
            raise ClusterReadError(f"{what}: {exc}") from exc

    def inference_node(self, name: str) -> dict[str, Any] | None:
        return self._call(f"read InferenceNode {name}", self._custom.get_cluster_custom_object,
                          GROUP, VERSION, "inferencenodes", name)

    def tenant_quotas(self) -> list[dict[str, Any]]:
        found = self._call("list TenantQuotas", self._custom.list_cluster_custom_object,
                           GROUP, VERSION, "tenantquotas")
        return list((found or {}).get("items") or [])

    def secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self._call(f"read Secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace)
        if found is None:
            return None
        return {"data": dict(found.data or {}), "stringData": dict(getattr(found, "string_data", None) or {})}


class _Periodic:
    """A background ``run()`` task on the running loop, started once and cancelled on stop."""

    _task: "asyncio.Task[None] | None" = None

    async def run(self) -> None:
        raise NotImplementedError

    def start(self):  # type: ignore[no-untyped-def]
        self._task = asyncio.get_running_loop().create_task(self.run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


class TenantSync(_Periodic):
    """Keeps a running server's tenants equal to the cluster's TenantQuotas and their Secrets.

    ``reader`` needs ``tenant_quotas()`` and ``secret(namespace, name)`` (a
    :class:`KubeReader`); ``apply`` receives the new tenant list when it changed.
    """

    def __init__(self, reader: Any, apply: Callable[[list[Tenant]], None], *, namespace: str,
                 interval_s: float = 10.0) -> None:
        self.reader = reader
        self.apply = apply
        self.namespace = namespace
        self.interval_s = interval_s
        self._last: str | None = None
        self.errors = 0

    def read(self) -> list[Tenant]:
        """One blocking read of quotas and the Secrets they name."""
        quotas = self.reader.tenant_quotas()
        secrets: dict[tuple[str, str], Mapping[str, Any]] = {}
        for quota in quotas:
            namespace, name, _ = secret_ref(quota, self.namespace)
            if name and (namespace, name) not in secrets:
                secret = self.reader.secret(namespace, name)
                if secret is not None:
                    secrets[(namespace, name)] = secret
        return tenants_from_quotas(quotas, secrets, self.namespace)

    async def sync_once(self) -> bool:
        """Read and apply if changed. Returns True when tenants were replaced."""
        tenants = await asyncio.to_thread(self.read)
        digest = fingerprint(tenants)
        if digest == self._last:
            return False
        self._last = digest
        self.apply(tenants)
        log.info("tenants from the cluster: %s", ", ".join(sorted(t.name for t in tenants)) or "none")
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except ClusterReadError as exc:
                self.errors += 1
                log.warning("tenant sync failed (keeping the current tenants): %s", exc)
            await asyncio.sleep(self.interval_s)



# What a running runtime can take from an edited InferenceNode without a restart, and what not.
LIVE_KEYS = ("scheduler",)
RESTART_KEYS = ("engine", "listen", "tls", "telemetry", "limits")


class NodeSpecSync(_Periodic):
    """Applies edits of this node's InferenceNode to the running runtime.

    Scheduler settings (shedding marks, preemption) apply live through ``apply_scheduler``;
    a change that needs a new process (engine, model, port, sampling period, limits) is
    logged once per new spec and reported through ``restart_needed`` — in a cluster the
    runtime's pod is the unit of that change.
    """

    def __init__(self, reader: Any, node: str, base: Mapping[str, Any] | None,
                 apply_scheduler: Callable[[Mapping[str, Any]], None], *, interval_s: float = 10.0) -> None:
        self.reader = reader
        self.node = node
        self.base = dict(base or {})
        self.apply_scheduler = apply_scheduler
        self.interval_s = interval_s
        self._applied: dict[str, Any] | None = None
        self.restart_needed: list[str] = []
        self.errors = 0

    def prime(self, inode: Mapping[str, Any]) -> None:
        """Remember the spec the process was started from."""
        self._applied = config_from_inferencenode(inode, self.base)

    async def sync_once(self) -> bool:
        """Read the InferenceNode; True when scheduler settings were applied."""
        inode = await asyncio.to_thread(self.reader.inference_node, self.node)
        if inode is None:
            log.warning("InferenceNode %s not found; keeping the current settings", self.node)
            return False
        wanted = config_from_inferencenode(inode, self.base)
        previous = self._applied
        if previous is None:
            self._applied = wanted
            return False
        stale = [k for k in RESTART_KEYS if wanted.get(k) != previous.get(k)]
        if stale and not set(stale) <= set(self.restart_needed):
            self.restart_needed = sorted(set(self.restart_needed) | set(stale))
            log.warning("InferenceNode %s changed %s: takes effect when the runtime restarts",
                        self.node, ", ".join(stale))
        applied = False
        if wanted.get("scheduler") != previous.get("scheduler"):
            self.apply_scheduler(wanted.get("scheduler") or {})  # raises on invalid marks: nothing recorded
            log.info("InferenceNode %s: scheduler settings applied live: %s", self.node, wanted.get("scheduler"))
            applied = True
        self._applied = wanted
        return applied

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
            except (ClusterReadError, ConfigError, ValueError) as exc:  # SchedulerConfigError is a ValueError
                self.errors += 1
                log.warning("InferenceNode sync failed (keeping the current settings): %s", exc)

