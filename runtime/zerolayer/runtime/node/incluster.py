"""In-cluster mode: the node's InferenceNode says what to serve; TenantQuotas and the key hashes
the operator publishes say who.

Pure builders turn API objects into the same config mapping the standalone file uses
(:func:`config_from_inferencenode`) and into tenants (:func:`tenants_from_quotas`).
:class:`KubeReader` is the only place this mode calls the Kubernetes API (blocking client,
always run in a thread). :class:`TenantSync` watches TenantQuotas and the one Secret of key
hashes and applies changes to a running server without a restart (``RuntimeServer.replace_tenants``);
:class:`NodeSpecSync` watches this node's own InferenceNode. Both use
:class:`zerolayer.kubewatch.WatchLoop`: one LIST, then a watch resumed from its last
resourceVersion (LIST again only after 410 Gone), so an idle runtime makes no reads at all.

Runtimes never read tenants' API-key Secrets: the operator reads each one and publishes only
SHA-256 hashes into one Secret per fleet, ``zl-tenant-keys`` in the runtime namespace (one data
entry per TenantQuota, see ``operator/manifests.py`` ``build_tenant_key_entry``). That Secret is
watched by name (a ``metadata.name`` field selector, which RBAC authorises by ``resourceNames``),
and a tenant's unreadable Secret costs that tenant only.
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
from typing import Any, Awaitable, Callable, Mapping, Sequence

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
SERVER_FIELDS = {"serverCore": "core", "apiProcesses": "api_processes", "maxConnectionAgeSeconds": "max_connection_age_s",
                 "maxConnectionAgeGraceSeconds": "max_connection_age_grace_s"}  # spec.runtime -> server.*


def server_section(runtime: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``server:`` from the node's ``spec.runtime`` over the base file's: ``serverCore`` (the
    HTTP/2 core, docs/server-core.md), ``apiProcesses`` (docs/api-processes.md) and the connection age
    (``maxConnectionAge(Grace)Seconds``, docs/runtime.md); else the base's."""
    return {**base, **{key: runtime[field] for field, key in SERVER_FIELDS.items() if field in runtime}}


def config_from_inferencenode(inode: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The standalone-config mapping for this node, from its InferenceNode (``base`` fills the rest).

    The vllm engine serves every model of ``spec.models``, the ``default`` one (else the first)
    answering requests that name none: one model is ``engine:``, several are ``engines:`` (one vLLM
    engine each, default first, on the GPUs :func:`zerolayer.models.gpu_plan` gives it). Weights
    and LoRA adapters are loaded from where the operator mounts their sources
    (:func:`zerolayer.models.container_path`). The scheduler's thresholds map onto its shedding
    marks; ``sampleIntervalMs`` onto the telemetry period. ``tlsSecretName`` turns on TLS with the
    certificate the operator mounts at :data:`TLS_DIR` (the probes then use HTTPS). ``serverCore``
    becomes ``server.core``: which HTTP/2 core serves (``python`` or ``native``, the compiled one);
    ``apiProcesses`` becomes ``server.api_processes`` (``zerolayer runtime --api-processes`` overrides both).
    """
    spec = inode.get("spec") or {}
    config: dict[str, Any] = {k: v for k, v in (base or {}).items()}
    runtime = spec.get("runtime") or {}
    models = spec.get("models") or []
    if not models:
        raise ConfigError(f"InferenceNode {inode.get('metadata', {}).get('name')}: spec.models is empty")
    default = next((m for m in models if m.get("default")), models[0])
    ordered = [default, *(m for m in models if m is not default)]
    kind = runtime.get("engine", "vllm")
    base_engine = config.pop("engine", None)
    config.pop("engines", None)
    if kind == "synthetic":
        # A synthetic base engine keeps its pace (ttft_ms, tokens_per_second...): tests and benches
        # give slow streams that way; the models are always the InferenceNode's.
        paced = dict(base_engine) if isinstance(base_engine, Mapping) and base_engine.get("kind") == "synthetic" else {}
        config["engine"] = {**paced, "kind": "synthetic", "models": [m["name"] for m in ordered],
                            **prefix_digest_setting(spec)}  # kvEvents: the runtime refuses it by name too
    elif len(ordered) == 1 and not ordered[0].get("gpus"):
        config["engine"] = vllm_model_engine(spec, ordered[0])  # the whole pod's GPUs
    else:
        try:
            plan = model_layout.gpu_plan(models, int(runtime.get("gpus", 1)))
        except model_layout.GpuPlanError as exc:
            raise ConfigError(f"InferenceNode models: {exc}") from exc
        devices = {id(m): p for m, p in zip(models, plan)}
        engines = [vllm_model_engine(spec, m, devices[id(m)]) for m in ordered]
        config.update({"engine": engines[0]} if len(engines) == 1 else {"engines": engines})
    if "gpu" not in config:
        config["gpu"] = gpu_source_settings(runtime)
    listen = dict(config.get("listen") or {})
    listen.setdefault("host", "0.0.0.0")  # a pod serves on its own IP
    listen["port"] = int(runtime.get("port", 8443))
    config["listen"] = listen
    if runtime.get("tlsSecretName"):
        config["tls"] = {"cert": f"{TLS_DIR}/tls.crt", "key": f"{TLS_DIR}/tls.key"}
    if any(field in runtime for field in SERVER_FIELDS):
        config["server"] = server_section(runtime, config.get("server") or {})
    scheduler = spec.get("scheduler") or {}
    config["scheduler"] = scheduler_marks(scheduler, config.get("scheduler") or {})
    if "sampleIntervalMs" in scheduler:
        config["telemetry"] = {**(config.get("telemetry") or {}), "sample_interval_ms": scheduler["sampleIntervalMs"]}
    limits = dict(config.get("limits") or {})
    if "drainSeconds" in runtime:
        limits["drain_timeout_s"] = max(1, int(runtime["drainSeconds"]))
    if limits:
        config["limits"] = limits
    return config



def scheduler_marks(scheduler: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The micro-scheduler's shedding marks from ``spec.scheduler``, laid over ``base``'s."""
    marks = dict(base)
    for ours, theirs in (("low_shed_at", "memoryThreshold"), ("normal_shed_at", "normalThreshold"),
                         ("low_resume_below", "resumeThreshold"), ("max_preemptions_per_tick",
                                                                    "maxPreemptionsPerTick"),
                         ("pressure_signal", "pressureSignal")):
        if theirs in scheduler:
            marks[ours] = scheduler[theirs]
    if "resumeThreshold" in scheduler and "normalThreshold" in scheduler:
        # One resume mark in the CRD: normal resumes the same distance below its own mark as low does.
        gap = float(scheduler.get("memoryThreshold", 0.92)) - float(scheduler["resumeThreshold"])
        marks["normal_resume_below"] = float(scheduler["normalThreshold"]) - gap
    return marks

# spec.runtime's typed engine settings -> the standalone engine keys (vLLM's argument names).
ENGINE_FIELDS = (("maxNumSeqs", "max_num_seqs"), ("maxNumBatchedTokens", "max_num_batched_tokens"),
                 ("dtype", "dtype"), ("enforceEager", "enforce_eager"), ("quantization", "quantization"),
                 ("enablePrefixCaching", "enable_prefix_caching"))


def vllm_model_engine(spec: Mapping[str, Any], model: Mapping[str, Any],
                      plan: tuple[tuple[int, ...], int] | None = None) -> dict[str, Any]:
    """The vllm engine mapping for one of ``spec.models``: its mounted weights, served name, tool-call
    parser, LoRA adapters, the node's engine settings (:func:`vllm_engine_settings`) and, with
    several models, its GPUs (``plan``: device indices and how many engines share them)."""
    def path(entry: Mapping[str, Any], what: str) -> str:
        try:
            return model_layout.container_path(entry)
        except model_layout.ModelSourceError as exc:
            raise ConfigError(f"InferenceNode {what} {entry.get('name')!r}: {exc}") from exc

    engine: dict[str, Any] = {"kind": "vllm", "model_path": path(model, "model"), "served_name": model["name"],
                              **vllm_engine_settings(spec, model, plan)}
    if model.get("toolCallParser"):
        engine["tool_parser"] = model["toolCallParser"]
    if model.get("loras"):
        engine["loras"] = [{"name": a["name"], "path": path(a, "adapter")} for a in model["loras"]]
    return engine


def vllm_engine_settings(spec: Mapping[str, Any], model: Mapping[str, Any] | None = None,
                         plan: tuple[tuple[int, ...], int] | None = None) -> dict[str, Any]:
    """The vllm engine keys an InferenceNode's spec sets for ``model`` (default: the default model),
    model path and name aside.

    ``models[].maxModelLen`` -> ``max_model_len`` (unset: the model's own limit); ``kvCacheBytes``
    -> ``kv_cache_memory_bytes``, else ``gpuMemoryUtilization`` -> ``gpu_memory_utilization``
    (vLLM ignores the fraction when the size is fixed, so only one goes); ``tensor_parallel_size``
    is the number of GPUs the engine sees unless ``engineArgs`` sets it (0 GPUs: 1); the typed
    knobs of :data:`ENGINE_FIELDS`; ``gossip.prefixDigestSource`` -> ``prefix_digest``
    (:func:`prefix_digest_setting`); ``engineArgs`` -> ``engine_args`` unchanged (the runtime refuses
    a name vLLM does not take, or one a typed field also sets, as the operator does at admission).
    With a ``plan`` (several models on GPUs) the engine gets ``gpus`` (its device indices), and
    engines sharing devices split the memory fraction (default 0.9) equally.
    """
    runtime = spec.get("runtime") or {}
    if model is None:
        models = spec.get("models") or [{}]
        model = next((m for m in models if m.get("default")), models[0])
    engine_args = dict(runtime.get("engineArgs") or {})
    engine: dict[str, Any] = {}
    if model.get("maxModelLen"):
        engine["max_model_len"] = int(model["maxModelLen"])
    devices, sharing = plan if plan is not None else ((), 1)
    if runtime.get("kvCacheBytes"):
        engine["kv_cache_memory_bytes"] = int(runtime["kvCacheBytes"])
    elif runtime.get("gpuMemoryUtilization") is not None or sharing > 1:
        from zerolayer.runtime.engine.vllm_engine import VllmSettings

        fraction = float(runtime.get("gpuMemoryUtilization") or VllmSettings.DEFAULT_GPU_MEMORY_UTILIZATION)
        engine["gpu_memory_utilization"] = round(fraction / sharing, 4)
    if devices:
        engine["gpus"] = list(devices)
    if "tensor_parallel_size" not in engine_args:
        engine["tensor_parallel_size"] = len(devices) if devices else max(1, int(runtime.get("gpus", 1)))
    for theirs, ours in ENGINE_FIELDS:
        if runtime.get(theirs) is not None:
            engine[ours] = runtime[theirs]
    engine.update(prefix_digest_setting(spec))
    if engine_args:
        engine["engine_args"] = engine_args
    return engine


# spec.gossip.prefixDigestSource -> the engine's prefix_digest (runtime/config.py PREFIX_DIGESTS).
PREFIX_DIGEST_SOURCES = {"served": "served", "kvEvents": "kv_events"}


def prefix_digest_setting(spec: Mapping[str, Any]) -> dict[str, str]:
    """``{"prefix_digest": ...}`` from ``spec.gossip.prefixDigestSource`` (``kvEvents`` ->
    ``kv_events``), or nothing when unset (the engine's default, ``served``). The operator refuses
    ``kvEvents`` where it cannot work (validation.prefix_digest_problems) before a runtime starts."""
    source = (spec.get("gossip") or {}).get("prefixDigestSource")
    if source is None:
        return {}
    if source not in PREFIX_DIGEST_SOURCES:
        raise ConfigError(f"InferenceNode spec.gossip.prefixDigestSource: one of "
                          f"{', '.join(PREFIX_DIGEST_SOURCES)}, got {source!r}")
    return {"prefix_digest": PREFIX_DIGEST_SOURCES[source]}


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

    def claim_api(self) -> Any:
        """The fleet quota claims' API (:class:`zerolayer.runtime.node.fleetquota.ClaimApi`) on this configuration."""
        from zerolayer.runtime.node.fleetquota import ClaimApi

        return ClaimApi(self._custom)

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

    # Watches (kubewatch.WatchLoop: LIST once, then WATCH resumed from the last resourceVersion).
    def watch_tenant_quotas(self, on_change: Callable[[], None], *, retry_s: float = 2.0) -> Any:
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._custom.list_cluster_custom_object, GROUP, VERSION, "tenantquotas",
                         name="tenantquotas", on_change=on_change, retry_s=retry_s)

    def watch_tenant_keys(self, namespace: str, on_change: Callable[[], None], *, name: str = TENANT_KEYS_SECRET,
                          retry_s: float = 2.0) -> Any:
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._core.list_namespaced_secret, namespace, name=f"secret-{name}",
                         field_selector=f"metadata.name={name}", on_change=on_change, retry_s=retry_s,
                         api_client=self._core.api_client)

    def watch_inference_node(self, node: str, on_change: Callable[[], None], *, retry_s: float = 2.0) -> Any:
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._custom.list_cluster_custom_object, GROUP, VERSION, "inferencenodes",
                         name=f"inferencenode-{node}", field_selector=f"metadata.name={node}",
                         on_change=on_change, retry_s=retry_s)


class _Watching(abc.ABC):
    """A background task on the running loop that owns some :class:`~zerolayer.kubewatch.WatchLoop`
    threads: their ``on_change`` marks the task dirty (thread-safe), the task re-derives its state
    on the event loop. Several events in a burst cost one recomputation. Started once, stopped
    (watch threads included) on :meth:`stop`."""

    _task: "asyncio.Task[None] | None" = None
    _loop: "asyncio.AbstractEventLoop | None" = None
    _dirty: "asyncio.Event | None" = None
    watches: list[Any]

    @abc.abstractmethod
    def open_watches(self) -> list[Any]:
        """Build (not start) the WatchLoops; their ``on_change`` must be :meth:`_mark`."""

    @abc.abstractmethod
    async def on_change(self) -> None:
        """Re-derive state from the watches' caches (runs on the event loop)."""

    def _mark(self) -> None:
        if self._loop is not None and self._dirty is not None:
            self._loop.call_soon_threadsafe(self._dirty.set)

    def start(self):  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        self._dirty = asyncio.Event()
        self.watches = self.open_watches()
        for watch in self.watches:
            watch.start()
        self._task = self._loop.create_task(self.run())
        return self

    async def run(self) -> None:
        assert self._dirty is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.on_change()
            except Exception as exc:  # noqa: BLE001 - a dead task would stop revocations silently
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        log.exception("%s failed (keeping the current state)", type(self).__name__)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for watch in getattr(self, "watches", []):
            await asyncio.to_thread(watch.stop)


class TenantSync(_Watching):
    """Keeps a running server's tenants equal to the cluster's TenantQuotas and published key hashes.

    ``reader`` needs ``tenant_quotas()`` and ``tenant_keys(namespace)`` for :meth:`sync_once` (one
    LIST and one GET, used once before serving), and ``watch_tenant_quotas`` /
    ``watch_tenant_keys`` for :meth:`start` (a :class:`KubeReader`). After start nothing is polled:
    a TenantQuota or key-hash change arrives as a watch event and is applied within one event-loop
    turn; status-only updates (usage, claims) re-derive the same fingerprint and apply nothing.
    ``apply`` receives the new tenant list when it changed. ``retry_s`` (the CLI's
    ``--tenant-sync-seconds``) is how long a failed watch waits before it tries again.
    ``problems`` says which TenantQuotas are not served and why; ``errors`` counts failed reads
    and failed watch requests, and ``registry``, when given, exports both
    (``zerolayer_tenant_sync_errors_total``, ``zerolayer_tenant_refused``).
    """

    def __init__(self, reader: Any, apply: Callable[[list[Tenant]], None], *, namespace: str,
                 interval_s: float = 10.0, registry: Any = None) -> None:
        self.reader = reader
        self.apply = apply
        self.namespace = namespace
        self.retry_s = interval_s
        self._last: str | None = None
        self._errors = 0
        self.problems: dict[str, str] = {}
        self._metrics = _SyncMetrics(registry) if registry is not None else None
        self._quotas: Any = None
        self._keys: Any = None
        self._watch_errors_seen = 0

    @property
    def errors(self) -> int:
        return self._errors + sum(w.counters.errors for w in getattr(self, "watches", []))

    def read(self) -> TenantView:
        """One blocking read of the quotas and the published key hashes."""
        quotas = self.reader.tenant_quotas()
        return tenants_from_quotas(quotas, self.reader.tenant_keys(self.namespace))

    def view_from_watches(self) -> TenantView | None:
        """The tenants the watches' caches say; None until both have listed once."""
        if self._quotas is None or self._keys is None:
            return None
        if not (self._quotas.started.is_set() and self._keys.started.is_set()):
            return None
        secrets = list(self._keys.objects.values())
        published = published_entries(secrets[0] if secrets else None)
        return tenants_from_quotas(list(self._quotas.objects.values()), published)

    def use(self, view: TenantView) -> bool:
        """Apply ``view`` if it differs from what was applied last. True when tenants were replaced."""
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

    async def sync_once(self) -> bool:
        """Read (LIST + GET) and apply if changed. Returns True when tenants were replaced."""
        return self.use(await asyncio.to_thread(self.read))

    async def first_sync(self) -> bool:
        """The sync before serving. A failure is logged and counted, not raised: the runtime then
        starts with no tenants (every key refused) and the watches started by :meth:`start` keep trying."""
        try:
            await self.sync_once()
            return True
        except Exception as exc:  # noqa: BLE001 - serving the health endpoints beats exiting
            self._failed(exc)
            return False

    def open_watches(self) -> list[Any]:
        self._quotas = self.reader.watch_tenant_quotas(self._mark, retry_s=self.retry_s)
        self._keys = self.reader.watch_tenant_keys(self.namespace, self._mark, retry_s=self.retry_s)
        return [self._quotas, self._keys]

    async def on_change(self) -> None:
        self._count_watch_errors()
        view = self.view_from_watches()
        if view is not None:
            self.use(view)

    def _count_watch_errors(self) -> None:
        total = sum(w.counters.errors for w in self.watches)
        if self._metrics is not None and total > self._watch_errors_seen:
            self._metrics.errors.labels("read").inc(total - self._watch_errors_seen)
        self._watch_errors_seen = total

    def _failed(self, exc: BaseException) -> None:
        self._errors += 1
        if self._metrics is not None:
            self._metrics.errors.labels("read" if isinstance(exc, ClusterReadError) else "unexpected").inc()
        if isinstance(exc, ClusterReadError):
            log.warning("tenant sync failed (keeping the current tenants): %s", exc)
        else:
            log.exception("tenant sync failed unexpectedly (keeping the current tenants)")


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
# LoRA adapters (an engine's ``loras``) are live too: they are compared apart (:func:`wanted_adapters`).
LIVE_KEYS = ("scheduler", "loras")
RESTART_KEYS = ("engine", "engines", "gpu", "listen", "tls", "server", "telemetry", "limits")


def _engines(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [config["engine"]] if config.get("engine") else list(config.get("engines") or ())


def wanted_adapters(config: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Base model -> {adapter name: path} of every vllm engine in a config mapping."""
    return {e["served_name"]: {a["name"]: a["path"] for a in e.get("loras") or ()}
            for e in _engines(config) if e.get("kind") == "vllm" and e.get("served_name")}


def restart_view(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as far as a change of it needs a new process: an engine's adapter list reduced to
    whether LoRA is on at all (vLLM fixes that at start; ``engine_args`` ``enable_lora`` keeps it on
    with no adapter), since adapters themselves load and unload in the running engine."""
    def reduced(engine: Mapping[str, Any]) -> dict[str, Any]:
        rest = {k: v for k, v in engine.items() if k != "loras"}
        rest["lora_on"] = bool(engine.get("loras")) or bool((engine.get("engine_args") or {}).get("enable_lora"))
        return rest

    view = dict(config)
    if config.get("engine"):
        view["engine"] = reduced(config["engine"])
    if config.get("engines"):
        view["engines"] = [reduced(e) for e in config["engines"]]
    return view


@dataclasses.dataclass
class AdapterSync:
    """What one :func:`sync_adapters` did: adapter names loaded or unloaded, and one message per
    adapter that could not be changed."""

    changed: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)


async def sync_adapters(engine: Any, wanted: Mapping[str, Mapping[str, str]]) -> AdapterSync:
    """Make each base model's engine serve exactly its ``wanted`` adapters (name -> path): unload the
    others (and those whose path changed), then load the missing ones through vLLM's dynamic LoRA.
    An adapter that cannot be changed is reported; the others still are."""
    from zerolayer.runtime.engine.lora import LoraAdapter

    done = AdapterSync()
    failed = done.failed
    for base, adapters in wanted.items():
        if base not in engine.models:
            continue  # a model this process does not run: its restart brings it
        target = engine.for_model(base)
        lora = getattr(target, "lora", None)
        if lora is None:
            failed += [f"{name}: model {base!r} runs on an engine without LoRA" for name in adapters]
            continue
        current = {a.name: a.path for a in lora.adapters}
        for name, path in current.items():
            if adapters.get(name) != path:
                await _attempt(done, name, target.remove_adapter(name))
        for name, path in adapters.items():
            if current.get(name) == path:
                continue
            if name in engine.models:
                failed.append(f"{name}: that name is already served by another model")
                continue
            await _attempt(done, name, target.add_adapter(LoraAdapter(name, path)))
    return done


async def _attempt(done: AdapterSync, name: str, change: Awaitable[None]) -> None:
    try:
        await change
    except RuntimeServerError as exc:  # ConfigError and EngineError among them
        done.failed.append(f"{name}: {exc}")
    else:
        done.changed.append(name)


class NodeSpecSync(_Watching):
    """Applies edits of this node's InferenceNode to the running runtime.

    Scheduler settings (shedding marks, preemption) apply live through ``apply_scheduler``, and
    LoRA adapters through ``load_adapters(wanted)`` (:func:`sync_adapters` over the server's engine:
    base model -> {adapter: path}; returns what failed, which is logged and counted in ``errors``);
    a change that needs a new process (engine, model, port, sampling period, limits; see
    :func:`restart_view`) is logged once per new spec and reported through ``restart_needed`` — in
    a cluster the runtime's pod is the unit of that change. After :meth:`start` the object is watched by
    name (``reader.watch_inference_node``); the gossip heartbeats in its status arrive as
    events too and are skipped by ``metadata.generation`` (spec edits bump it, status does not).
    ``interval_s`` is how long a failed watch waits before it tries again.
    """

    def __init__(self, reader: Any, node: str, base: Mapping[str, Any] | None,
                 apply_scheduler: Callable[[Mapping[str, Any]], None], *, interval_s: float = 10.0,
                 load_adapters: Callable[[Mapping[str, Mapping[str, str]]], Awaitable[AdapterSync]] | None = None
                 ) -> None:
        self.reader = reader
        self.node = node
        self.base = dict(base or {})
        self.apply_scheduler = apply_scheduler
        self.load_adapters = load_adapters
        self._adapters_due: dict[str, dict[str, str]] | None = None
        self.adapter_failures: list[str] = []  # the last adapter sync's
        self.retry_s = interval_s
        self._applied: dict[str, Any] | None = None
        self._generation: Any = None
        self.restart_needed: list[str] = []
        self.errors = 0
        self._watch: Any = None
        self._refused_generation: Any = None

    def prime(self, inode: Mapping[str, Any]) -> None:
        """Remember the spec the process was started from."""
        self._applied = config_from_inferencenode(inode, self.base)
        self._generation = (inode.get("metadata") or {}).get("generation")

    def use(self, inode: Mapping[str, Any]) -> bool:
        """Apply what ``inode`` changed; True when scheduler settings were applied."""
        generation = (inode.get("metadata") or {}).get("generation")
        if generation is not None and self._applied is not None and generation in (self._generation,
                                                                                   self._refused_generation):
            return False  # a status update (heartbeat): the spec is the one applied (or already refused)
        wanted = config_from_inferencenode(inode, self.base)
        previous = self._applied
        if previous is None:
            self._applied, self._generation = wanted, generation
            return False
        self._adapters_due = wanted_adapters(wanted)  # diffed against what the engine serves
        now, before = restart_view(wanted), restart_view(previous)
        stale = [k for k in RESTART_KEYS if now.get(k) != before.get(k)]
        if stale and not set(stale) <= set(self.restart_needed):
            self.restart_needed = sorted(set(self.restart_needed) | set(stale))
            log.warning("InferenceNode %s changed %s: takes effect when the runtime restarts",
                        self.node, ", ".join(stale))
        applied = False
        if wanted.get("scheduler") != previous.get("scheduler"):
            try:
                self.apply_scheduler(wanted.get("scheduler") or {})
            except ValueError:  # invalid marks: nothing applied, and not tried again for this generation
                self._refused_generation = generation
                raise
            log.info("InferenceNode %s: scheduler settings applied live: %s", self.node, wanted.get("scheduler"))
            applied = True
        self._applied, self._generation = wanted, generation
        return applied

    async def sync_once(self) -> bool:
        """Read the InferenceNode (one GET) and :meth:`use` it."""
        inode = await asyncio.to_thread(self.reader.inference_node, self.node)
        if inode is None:
            log.warning("InferenceNode %s not found; keeping the current settings", self.node)
            return False
        return await self.apply(inode)

    async def apply(self, inode: Mapping[str, Any]) -> bool:
        """:meth:`use`, then load and unload the adapters the new spec names; True when anything
        was applied live."""
        applied = self.use(inode)
        due, self._adapters_due = self._adapters_due, None
        if due is None or self.load_adapters is None:
            return applied
        done = await self.load_adapters(due)
        self.adapter_failures = done.failed
        for failure in done.failed:
            self.errors += 1
            log.warning("InferenceNode %s: LoRA adapter not changed: %s", self.node, failure)
        if done.changed:
            log.info("InferenceNode %s: LoRA adapters loaded or unloaded live: %s", self.node,
                     ", ".join(done.changed))
        return applied or bool(done.changed)

    def open_watches(self) -> list[Any]:
        self._watch = self.reader.watch_inference_node(self.node, self._mark, retry_s=self.retry_s)
        return [self._watch]

    async def on_change(self) -> None:
        objects = list(self._watch.objects.values())
        if not objects:
            if self._watch.started.is_set():
                log.warning("InferenceNode %s not found; keeping the current settings", self.node)
            return
        await self.apply(objects[0])

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if isinstance(exc, (ClusterReadError, ConfigError, ValueError)):  # SchedulerConfigError is a ValueError
            log.warning("InferenceNode sync failed (keeping the current settings): %s", exc)
        else:
            log.exception("InferenceNode sync failed unexpectedly (keeping the current settings)")


# --------------------------------------------------------------------------- fleet-wide quotas
def attach_fleet_quota(server: Any, reader: KubeReader, node: str, *, settings: Any = None) -> Any:
    """Make ``server`` enforce tenants' limits across the fleet (docs/fleet-scale.md); returns the
    claim thread (:class:`zerolayer.runtime.node.fleetquota.FleetQuotaSync`), not started.

    The server's scheduler must be a :class:`~zerolayer.runtime.scheduler.fleet.FleetQuotaScheduler`
    (same Scheduler contract), built by the composition root (``compose(..., fleet_quota=True)``).
    ``start()`` the thread once the event loop runs and ``stop()`` it at exit.
    """
    from zerolayer.runtime.node.fleetquota import FleetQuotaSettings, FleetQuotaSync
    from zerolayer.runtime.scheduler.fleet import FleetQuotaScheduler

    fleet = server.scheduler
    if not isinstance(fleet, FleetQuotaScheduler):
        raise ConfigError("fleet quotas need the server built with a FleetQuotaScheduler "
                          "(zerolayer.runtime.compose.compose(..., fleet_quota=True))")
    return FleetQuotaSync(reader.claim_api(), fleet, node,
                          settings=settings or FleetQuotaSettings(window_s=fleet.window_s))
