"""In-cluster mode: the node's InferenceNode says what to serve; TenantQuotas and the key hashes
the operator publishes say who.

Pure builders turn API objects into the same config mapping the standalone file uses
(:func:`config_from_inferencenode`) and into tenants (:func:`tenants_from_quotas`).
:class:`KubeReader` is the only place this mode calls the Kubernetes API (blocking client,
always run in a thread). :class:`TenantSync` re-reads TenantQuotas and the one Secret of key
hashes and applies changes to a running server without a restart (``RuntimeServer.replace_tenants``).

Runtimes never read tenants' API-key Secrets: the operator reads each one and publishes only
SHA-256 hashes into one Secret per fleet, ``zl-tenant-keys`` in the runtime namespace (one data
entry per TenantQuota, see ``operator/manifests.py`` ``build_tenant_key_entry``). A sync is two
reads whatever the number of tenants, and a Secret that cannot be read costs its own tenant only.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import re
from typing import Any, Callable, Mapping, Sequence

from zerolayer import kubeaccess
from zerolayer import models as model_layout
from zerolayer.contract import Priority
from zerolayer.runtime.errors import ConfigError, RuntimeServerError
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.tenants import Tenant

log = logging.getLogger(__name__)

GROUP, VERSION = "zerolayer.io", "v1alpha1"
DEFAULT_PRIORITIES = ("normal", "low")  # the CRD's default
DEFAULT_MAX_STREAMS = 64
# Where the operator mounts the tlsSecretName Secret (operator/manifests.py TLS_MOUNT).
TLS_DIR = "/etc/zerolayer/tls"
# The Secret of key hashes the operator publishes in the runtime namespace (operator/manifests.py
# TENANT_KEYS_SECRET); runtimes may read this one Secret and no other.
TENANT_KEYS_SECRET = "zl-tenant-keys"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


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
        engine = {"kind": "vllm", "model_path": path, "served_name": model["name"], **vllm_engine_settings(spec)}
    config["engine"] = engine
    if "gpu" not in config:
        config["gpu"] = gpu_source_settings(runtime)
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


# spec.runtime's typed engine settings -> the standalone engine keys (vLLM's argument names).
ENGINE_FIELDS = (("maxNumSeqs", "max_num_seqs"), ("maxNumBatchedTokens", "max_num_batched_tokens"),
                 ("dtype", "dtype"), ("enforceEager", "enforce_eager"), ("quantization", "quantization"),
                 ("enablePrefixCaching", "enable_prefix_caching"))


def vllm_engine_settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The vllm engine keys an InferenceNode's spec sets (model path and name aside).

    ``models[].maxModelLen`` of the served model -> ``max_model_len`` (unset: the model's own
    limit); ``kvCacheBytes`` -> ``kv_cache_memory_bytes``, else ``gpuMemoryUtilization`` ->
    ``gpu_memory_utilization`` (vLLM ignores the fraction when the size is fixed, so only one goes);
    ``gpus`` -> ``tensor_parallel_size`` unless ``engineArgs`` sets it (0 GPUs: 1); the typed knobs
    of :data:`ENGINE_FIELDS`; ``engineArgs`` -> ``engine_args`` unchanged (the runtime refuses a name
    vLLM does not take, or one a typed field also sets, as the operator does at admission).
    """
    runtime = spec.get("runtime") or {}
    models = spec.get("models") or [{}]
    model = next((m for m in models if m.get("default")), models[0])
    engine_args = dict(runtime.get("engineArgs") or {})
    engine: dict[str, Any] = {}
    if model.get("maxModelLen"):
        engine["max_model_len"] = int(model["maxModelLen"])
    if runtime.get("kvCacheBytes"):
        engine["kv_cache_memory_bytes"] = int(runtime["kvCacheBytes"])
    elif runtime.get("gpuMemoryUtilization") is not None:
        engine["gpu_memory_utilization"] = float(runtime["gpuMemoryUtilization"])
    if "tensor_parallel_size" not in engine_args:
        engine["tensor_parallel_size"] = max(1, int(runtime.get("gpus", 1)))
    for theirs, ours in ENGINE_FIELDS:
        if runtime.get(theirs) is not None:
            engine[ours] = runtime[theirs]
    if engine_args:
        engine["engine_args"] = engine_args
    return engine


def gpu_source_settings(runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU source of an operator-deployed runtime: ``auto`` (NVML where the pod has GPUs, else
    the CPU source) when it requests GPUs, the CPU source when it requests none (CUDA images say
    ``NVIDIA_VISIBLE_DEVICES=all`` whatever was allocated). ``kvCacheBytes`` sizes the CPU
    source's memory."""
    source: dict[str, Any] = {"source": "auto" if int(runtime.get("gpus", 1)) > 0 else "cpu"}
    if runtime.get("kvCacheBytes"):
        source["kv_cache_bytes"] = int(runtime["kvCacheBytes"])
    return source


def published_entries(secret: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The operator's published key hashes, by TenantQuota name: ``{"tenant", "created", "hashes"}``.

    ``secret`` is the ``zl-tenant-keys`` Secret's ``data`` as the API returns it (base64 JSON per
    entry). An entry that does not decode, or holds anything but SHA-256 hex digests, is left out
    and logged: its tenant is not served rather than served with keys nobody meant.
    """
    entries: dict[str, dict[str, Any]] = {}
    for quota_name, raw in ((secret or {}).get("data") or {}).items():
        try:
            entry = json.loads(base64.b64decode(raw).decode())
            hashes = [str(h).lower() for h in entry["hashes"]]
            if not isinstance(entry.get("tenant"), str) or not all(_SHA256_HEX.match(h) for h in hashes):
                raise ValueError("not a tenant name and SHA-256 hex digests")
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            log.warning("published key hashes for TenantQuota %s do not decode (%s); tenant not served",
                        quota_name, exc)
            continue
        entries[quota_name] = {"tenant": entry["tenant"], "created": str(entry.get("created") or ""),
                               "hashes": frozenset(hashes)}
    return entries


@dataclasses.dataclass
class TenantView:
    """What the cluster says: the tenants to serve, and why each other TenantQuota is not served
    (TenantQuota name -> reason)."""

    tenants: list[Tenant]
    problems: dict[str, str]


def _policy(name: str, spec: Mapping[str, Any]) -> TenantPolicy:
    models = spec.get("allowedModels")
    return TenantPolicy(
        tenant=name,
        tokens_per_minute=spec.get("tokensPerMinute"),
        requests_per_minute=spec.get("requestsPerMinute"),
        max_concurrent_streams=spec.get("maxConcurrentStreams", DEFAULT_MAX_STREAMS),
        allowed_priorities=frozenset(Priority.parse(p) for p in spec.get("allowedPriorities", DEFAULT_PRIORITIES)),
        allowed_models=frozenset(models) if models else None,
    )


def _age(quota: Mapping[str, Any]) -> tuple[str, str]:
    meta = quota.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def tenants_from_quotas(quotas: Sequence[Mapping[str, Any]],
                        published: Mapping[str, Mapping[str, Any]]) -> TenantView:
    """Tenants with their key hashes and policies.

    ``published`` is :func:`published_entries`. A quota with no published hashes yields no
    tenant: nobody can authenticate as it until the operator has read its keys. Quotas are
    taken oldest first (creationTimestamp, then name); a later quota that names a tenant
    already served, or holds a key hash an earlier one holds, is refused whole, so a key is
    never billed to the wrong tenant and two policies are never merged.
    """
    tenants: list[Tenant] = []
    problems: dict[str, str] = {}
    owner_of_name: dict[str, str] = {}
    owner_of_hash: dict[str, str] = {}
    for quota in sorted(quotas, key=_age):
        spec = quota.get("spec") or {}
        quota_name = (quota.get("metadata") or {}).get("name", "")
        name = spec.get("tenant")
        entry = published.get(quota_name)
        if not name or entry is None or not entry["hashes"]:
            problems[quota_name] = "no published key hashes (see the TenantQuota's conditions)"
        elif entry["tenant"] != name:
            problems[quota_name] = f"published hashes are for tenant {entry['tenant']!r}, not {name!r}"
        elif name in owner_of_name:
            problems[quota_name] = f"tenant {name!r} is already served from TenantQuota {owner_of_name[name]}"
        elif entry["hashes"] & owner_of_hash.keys():
            other = owner_of_hash[min(entry["hashes"] & owner_of_hash.keys())]
            problems[quota_name] = f"a key is also a key of TenantQuota {other}"
        else:
            owner_of_name[name] = quota_name
            owner_of_hash.update(dict.fromkeys(entry["hashes"], quota_name))
            tenants.append(Tenant(name, frozenset(entry["hashes"]), _policy(name, spec)))
    return TenantView(tenants, problems)


def fingerprint(tenants: Sequence[Tenant]) -> str:
    """Changes only when who may call, or with what limits, changes."""
    parts = sorted(f"{t.name}|{sorted(t.key_hashes)}|{t.policy!r}" for t in tenants)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# --------------------------------------------------------------------------- API access
class KubeReader:
    """Every Kubernetes call of in-cluster mode. Blocking: call from a thread."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        try:
            from kubernetes import client
        except ImportError as exc:  # pragma: no cover - kubernetes is a base dependency
            raise ClusterReadError("the kubernetes client is not installed") from exc
        try:
            api = kubeaccess.api_client(kubeconfig)
        except kubeaccess.KubeConfigError as exc:
            raise ClusterReadError(str(exc)) from exc
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

    def tenant_keys(self, namespace: str, name: str = TENANT_KEYS_SECRET) -> dict[str, dict[str, Any]]:
        """The operator's published key hashes (:func:`published_entries`); empty before it published any."""
        found = self._call(f"read Secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace)
        return published_entries({"data": dict(found.data or {})} if found is not None else None)


class _Periodic(abc.ABC):
    """A background ``run()`` task on the running loop, started once and cancelled on stop."""

    _task: "asyncio.Task[None] | None" = None

    @abc.abstractmethod
    async def run(self) -> None:
        """The loop itself; subclasses say what one period does."""

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
    """Keeps a running server's tenants equal to the cluster's TenantQuotas and published key hashes.

    ``reader`` needs ``tenant_quotas()`` and ``tenant_keys(namespace)`` (a :class:`KubeReader`);
    ``apply`` receives the new tenant list when it changed. One sync costs two reads however
    many tenants there are. ``problems`` says which TenantQuotas are not served and why;
    ``errors`` counts failed syncs (any exception: the loop never dies), and ``registry``, when
    given, exports both (``zerolayer_tenant_sync_errors_total``, ``zerolayer_tenant_refused``).
    """

    def __init__(self, reader: Any, apply: Callable[[list[Tenant]], None], *, namespace: str,
                 interval_s: float = 10.0, registry: Any = None) -> None:
        self.reader = reader
        self.apply = apply
        self.namespace = namespace
        self.interval_s = interval_s
        self._last: str | None = None
        self.errors = 0
        self.problems: dict[str, str] = {}
        self._metrics = _SyncMetrics(registry) if registry is not None else None

    def read(self) -> TenantView:
        """One blocking read of the quotas and the published key hashes."""
        quotas = self.reader.tenant_quotas()
        return tenants_from_quotas(quotas, self.reader.tenant_keys(self.namespace))

    async def sync_once(self) -> bool:
        """Read and apply if changed. Returns True when tenants were replaced."""
        view = await asyncio.to_thread(self.read)
        for quota, why in sorted(view.problems.items()):
            if self.problems.get(quota) != why:
                log.warning("TenantQuota %s not served: %s", quota, why)
        self.problems = view.problems
        if self._metrics is not None:
            self._metrics.refused(view.problems)
        digest = fingerprint(view.tenants)
        if digest == self._last:
            return False
        self._last = digest
        self.apply(view.tenants)
        log.info("tenants from the cluster: %s", ", ".join(sorted(t.name for t in view.tenants)) or "none")
        return True

    async def first_sync(self) -> bool:
        """The sync before serving. A failure is logged and counted, not raised: the runtime then
        starts with no tenants (every key refused) and :meth:`run` keeps trying."""
        try:
            await self.sync_once()
            return True
        except Exception as exc:  # noqa: BLE001 - serving the health endpoints beats exiting
            self._failed(exc)
            return False

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self._metrics is not None:
            self._metrics.errors.labels("read" if isinstance(exc, ClusterReadError) else "unexpected").inc()
        if isinstance(exc, ClusterReadError):
            log.warning("tenant sync failed (keeping the current tenants): %s", exc)
        else:
            log.exception("tenant sync failed unexpectedly (keeping the current tenants)")

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except Exception as exc:  # noqa: BLE001 - a dead loop would stop revocations silently
                self._failed(exc)
            await asyncio.sleep(self.interval_s)


class _SyncMetrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.errors = Counter("zerolayer_tenant_sync_errors", "Failed tenant syncs, by kind (read, unexpected).",
                              ["kind"], registry=registry)
        self._refused = Gauge("zerolayer_tenant_refused", "1 for each TenantQuota this runtime does not serve.",
                              ["tenant_quota"], registry=registry)
        self._shown: set[str] = set()

    def refused(self, problems: Mapping[str, str]) -> None:
        for gone in self._shown - problems.keys():
            self._refused.remove(gone)
        for quota in problems:
            self._refused.labels(quota).set(1)
        self._shown = set(problems)


# What a running runtime can take from an edited InferenceNode without a restart, and what not.
LIVE_KEYS = ("scheduler",)
RESTART_KEYS = ("engine", "gpu", "listen", "tls", "telemetry", "limits")


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
            except Exception:  # noqa: BLE001 - the loop must outlive anything one object can cause
                self.errors += 1
                log.exception("InferenceNode sync failed unexpectedly (keeping the current settings)")

