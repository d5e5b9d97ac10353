"""Pure builders: custom resource in, Kubernetes manifests (plain dicts) out.

No I/O and no clock here (callers pass ``now``), so every builder is tested without a
cluster. Naming is deterministic, which is what makes reconciliation idempotent: one
InferenceNode or TenantQuota always maps to the same child names, so a retry after a
crash finds (and patches) what an earlier attempt created instead of making another.

Children and their owners:

- per InferenceNode, in the runtime namespace: DaemonSet, ServiceAccount, headless
  Service and NetworkPolicy ``zl-runtime-<name>``; cluster-wide: ClusterRole and
  ClusterRoleBinding ``zl-runtime-<name>``. All carry an owner reference to the
  InferenceNode (cluster-scoped owners are allowed for namespaced dependents).
- per InferenceNode, also in the runtime namespace: Role and RoleBinding ``zl-runtime-<name>``
  that let its ServiceAccount (by name) read the one Secret of key hashes.
- per TenantQuota: NetworkPolicy (or, with Cilium, a CiliumNetworkPolicy) in the runtime
  namespace, ``zl-tenant-<name>``, owned by the TenantQuota; and one data entry (its key
  hashes, :func:`build_tenant_key_entry`) in the fleet's ``zl-tenant-keys`` Secret.
- Runtimes never read tenants' Secrets: the operator reads them and publishes hashes only.
- Node labels cannot be owned: the InferenceNode's finalizer removes them.
- Runtime pods carry ``model.zerolayer.io/<model>: served`` per base model (:func:`model_labels`): the
  per-model Services and InferencePools (:mod:`.model_plan`) select them.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
import re
import urllib.parse
from typing import Any, Mapping, Sequence

from zerolayer import models as model_layout
from zerolayer.operator import runtime_config as rc
from zerolayer.operator.config import OperatorConfig

GROUP = "zerolayer.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Node labels the operator owns.
INFERENCE_NODE_LABEL = "zerolayer.io/inference-node"
GPU_TYPE_LABEL = "zerolayer.io/gpu-type"
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"  # NVIDIA GPU feature discovery
# On the Node: which InferenceNode serves it (one per node; a second one is refused).
CLAIM_ANNOTATION = "zerolayer.io/inference-node-name"

# Labels on every child.
APP_LABEL = "app.kubernetes.io/name"
RUNTIME_APP = "zerolayer-runtime"
MANAGED_BY = {"app.kubernetes.io/managed-by": "zerolayer-operator", "app.kubernetes.io/part-of": "zerolayer"}
OWNER_NODE_LABEL = "zerolayer.io/inference-node"  # on children: which InferenceNode (label-safe)
OWNER_TENANT_LABEL = "zerolayer.io/tenant-quota"
OWNER_NAME_ANNOTATION = "zerolayer.io/owner"  # the owner's exact name (labels may be hashed)
# On runtime pods: one label per base model served (model_labels), selected by the model's Service.
MODEL_LABEL_PREFIX = "model.zerolayer.io/"
MODEL_SERVED = "served"
# On the runtime pod template: hash of the spec the runtime's processes read once at start.
CONFIG_HASH_ANNOTATION = "zerolayer.io/runtime-config-hash"
# On the runtime pod template: the config file the runtime lays its InferenceNode over
# (:func:`~.runtime_config.runtime_config`, server.api_processes), read by the server container
# through a downward-API file at RUNTIME_CONFIG_FILE. Being on the template, a change rolls the pod.
RUNTIME_CONFIG_ANNOTATION = "zerolayer.io/runtime-config"
RUNTIME_CONFIG_MOUNT = "/etc/zerolayer/runtime"
RUNTIME_CONFIG_FILE = f"{RUNTIME_CONFIG_MOUNT}/config.yaml"

TLS_MOUNT = "/etc/zerolayer/tls"  # the tlsSecretName Secret (tls.crt, tls.key) in the server container
SERVING_PORT_NAME = "serving"  # containerPort name; policies use it so per-node ports need no lookup
METRICS_PORT_NAME = "metrics"  # the runtime's /metrics, admitted only from the scrapers' namespaces
AUDIT_METRICS_PORT_NAME = "audit-metrics"  # the auditor's /metrics (the chart's PodMonitor scrapes both)
AUDIT_METRICS_PORT = 9465  # beside the runtime's default 9464; the pod shares one network namespace
RUNTIME_UID = 65532

CILIUM_CRD = "ciliumnetworkpolicies.cilium.io"
CILIUM_API_VERSION = "cilium.io/v2"
# The one Secret of tenants' key hashes, in the runtime namespace (runtime/node/incluster.py reads it).
TENANT_KEYS_SECRET = "zl-tenant-keys"
DEFAULT_SECRET_KEY = "api-keys"

# Headers that carry a tenant's API key (zerolayer.contract.API_KEY and the bearer form).
API_KEY_HEADERS = ("x-api-key", "authorization")

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# --------------------------------------------------------------------------- names
def _shorten(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{value[: limit - 9].rstrip('-.')}-{digest}"


def runtime_name(inference_node: str) -> str:
    """Name of every child of an InferenceNode. At most 52 characters so DaemonSet pod
    names (name + 6) and label values (63) stay valid."""
    return _shorten(f"zl-runtime-{inference_node.replace('.', '-')}", 52)


def tenant_name(tenant_quota: str) -> str:
    """Name of every child of a TenantQuota."""
    return _shorten(f"zl-tenant-{tenant_quota.replace('.', '-')}", 63)


def label_value(value: str) -> str:
    """``value`` made into a valid label value (hashed when too long, invalid characters replaced)."""
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", value).strip("-_.")
    cleaned = _shorten(cleaned, 63).strip("-_.")
    return cleaned if _LABEL_VALUE.match(cleaned) else hashlib.sha256(value.encode()).hexdigest()[:16]


def owner_reference(owner: Mapping[str, Any]) -> dict:
    """Controller owner reference to a custom resource (cluster-scoped, so valid in any namespace)."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", API_VERSION),
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def foreign_controller(current: Mapping[str, Any], owner_uid: str | None) -> str | None:
    """``Kind/name`` of the controller of ``current`` when it is not the object with ``owner_uid``.

    Two owners can map to one child name (``a.b`` and ``a-b``); the child belongs to whichever
    created it, and the other must neither adopt, patch nor delete it."""
    for ref in (current.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller") and owner_uid and ref.get("uid") != owner_uid:
            return f"{ref.get('kind')}/{ref.get('name')}"
    return None


def _meta(name: str, namespace: str | None, owner: Mapping[str, Any], owner_label: str) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {**MANAGED_BY, owner_label: label_value(owner["metadata"]["name"])},
        "annotations": {OWNER_NAME_ANNOTATION: f"{owner['kind']}/{owner['metadata']['name']}"},
        "ownerReferences": [owner_reference(owner)],
    }
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


# --------------------------------------------------------------------------- InferenceNode
def node_labels(gpu_type: str | None) -> dict[str, str]:
    """Labels the operator puts on the Kubernetes Node (the GPU type only when known)."""
    labels = {INFERENCE_NODE_LABEL: "true"}
    if gpu_type:
        labels[GPU_TYPE_LABEL] = label_value(gpu_type)
    return labels


def gpu_type_of(spec: Mapping[str, Any], node: Mapping[str, Any] | None) -> str | None:
    """The GPU type: ``spec.gpuType``, else the node's GPU-feature-discovery product label."""
    if spec.get("gpuType"):
        return spec["gpuType"]
    if node:
        return (node.get("metadata", {}).get("labels") or {}).get(GFD_PRODUCT_LABEL)
    return None


def base_model_names(spec: Mapping[str, Any]) -> list[str]:
    """The base models an InferenceNode serves (``spec.models[].name``, not their LoRA adapters)."""
    return [str(x["name"]) for x in spec.get("models") or () if isinstance(x, Mapping) and x.get("name")]


def model_label_key(model: str) -> str:
    """``model.zerolayer.io/<name>``: the pod label that says the pod serves ``model``. A name that is
    not a valid label name as it is gets a cleaned prefix and 8 hex digits of its hash (two models
    never share a key)."""
    if len(model) <= 63 and _LABEL_VALUE.match(model):
        return MODEL_LABEL_PREFIX + model
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", model).strip("-_.")[:54].rstrip("-_.")
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{MODEL_LABEL_PREFIX}{cleaned}-{digest}" if cleaned else MODEL_LABEL_PREFIX + digest


def model_labels(models: Sequence[str]) -> dict[str, str]:
    """Labels on a runtime pod for each model it serves: what the per-model Services and
    InferencePools select (:mod:`.model_plan`)."""
    return {model_label_key(x): MODEL_SERVED for x in models}


def runtime_selector(inference_node: str) -> dict[str, str]:
    """Labels that select exactly one InferenceNode's runtime pods."""
    return {APP_LABEL: RUNTIME_APP, OWNER_NODE_LABEL: label_value(inference_node)}


def _merge_resources(defaults: Mapping[str, Any], override: Mapping[str, Any] | None, gpus: int) -> dict:
    merged: dict[str, dict] = {k: dict(v) for k, v in copy.deepcopy(dict(defaults)).items()}
    for section, values in (override or {}).items():
        merged.setdefault(section, {}).update(values)
    if gpus:
        # Extended resources must have request == limit; setting both states it plainly.
        merged.setdefault("requests", {})["nvidia.com/gpu"] = str(gpus)
        merged.setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
    return {k: {rk: str(rv) for rk, rv in v.items()} for k, v in merged.items() if v}


AUDIT_SPOOL = "/run/zerolayer/audit"  # shared by server (token counters, journal) and auditor
AUDIT_SPOOL_LIMIT = "1Gi"  # 32 journal segments of 32 MiB
AUDIT_DB = "/var/lib/zerolayer/audit/audit.db"
# vLLM's engine processes talk through shared-memory ring buffers in /dev/shm (160 MiB for the tiny
# CPU model already); a container's own /dev/shm is 64 MiB, where the engine refuses to start
# (seen on a real node). A memory-backed emptyDir, counted against the server's memory limit.
SHM_SIZE_LIMIT = "1Gi"
AUDIT_SOURCES = {"auto": "auto", "bpf": "bpf", "inprocess": "journal"}  # spec.audit.mode -> auditor --source


def _downward_env(inference_node: str) -> list[dict]:
    """Identity of the pod: ``ZEROLAYER_NODE_NAME`` is the InferenceNode (what the runtime's
    gossip and defragd read), ``NODE_NAME`` the Kubernetes Node, ``POD_IP`` the address the
    runtime advertises in the GPU map."""
    def field(path: str) -> dict:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    return [
        {"name": "ZEROLAYER_NODE_NAME", "value": inference_node},
        {"name": "NODE_NAME", "valueFrom": field("spec.nodeName")},
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
    ]


_NON_ROOT = {
    "runAsNonRoot": True,
    "runAsUser": RUNTIME_UID,
    "runAsGroup": RUNTIME_UID,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

# What bcc needs, and why: BPF (load programs, create maps), PERFMON (attach uprobes/USDT
# and tracepoints through perf_event_open), SYS_RESOURCE (raise RLIMIT_MEMLOCK for maps on
# kernels that still account BPF memory there), SYS_PTRACE (read the server's
# /proc/<pid>/{maps,root} to resolve its USDT probes), DAC_READ_SEARCH (read tracefs event
# formats and kernel headers regardless of their modes). Not privileged: no device access,
# no SYS_ADMIN.
AUDITOR_CAPABILITIES = ["BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH"]
# From Linux 5.11 BPF maps are charged to the memory cgroup, not RLIMIT_MEMLOCK, so SYS_RESOURCE
# buys nothing there; and asking for it fails the container outright ("unable to apply caps")
# wherever the node's root lacks it (some VM sandboxes), so it is added only where it is needed.
MEMCG_BPF_KERNEL = (5, 11)
_KERNEL_VERSION = re.compile(r"^(\d+)\.(\d+)")


# The chart's runtime.auditor.kernelMode: what lets the USDT probe (its semaphore, ref_ctr_offset)
# attach through perf_event_open on kernels that refuse it to PERFMON (6.18, measured: EACCES without
# it, every token metered with it; docs/security.md). Off by default: SYS_ADMIN is most of root.
KERNEL_MODE_CAPABILITIES = ["SYS_ADMIN"]
AUDITOR_KERNEL_MODE_ANNOTATION = "zerolayer.io/auditor-kernel-mode"


def auditor_capabilities(kernel_version: str | None, kernel_mode: bool = False) -> list[str]:
    """:data:`AUDITOR_CAPABILITIES` for a node whose ``status.nodeInfo.kernelVersion`` is
    ``kernel_version``: without ``SYS_RESOURCE`` from :data:`MEMCG_BPF_KERNEL` on; all of them when
    the version is unknown or does not parse. ``kernel_mode`` adds :data:`KERNEL_MODE_CAPABILITIES`."""
    match = _KERNEL_VERSION.match(kernel_version or "")
    extra = list(KERNEL_MODE_CAPABILITIES) if kernel_mode else []
    if match and (int(match[1]), int(match[2])) >= MEMCG_BPF_KERNEL:
        return [c for c in AUDITOR_CAPABILITIES if c != "SYS_RESOURCE"] + extra
    return list(AUDITOR_CAPABILITIES) + extra


def _host_path(name: str, path: str, kind: str) -> dict:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


# --------------------------------------------------------------------------- rolling on config change
# Spec fields the running processes re-read without a restart, so editing them must not roll
# the pod: the scheduler's marks (NodeSpecSync), the gossip settings and utilisation threshold
# (read from every status-patch response) and defragd's policy (read before each scan). gpuType only
# labels the Node. The electricity price is not live: the auditor takes it as an argument (its
# cost in status.usage), so a new price is a new pod template. Everything else in the spec
# (models, engine, port, TLS, drain, limits, sampling period, any field added later) rolls it.
LIVE_SPEC_FIELDS: tuple[tuple[str, ...], ...] = (
    ("scheduler", "memoryThreshold"), ("scheduler", "normalThreshold"), ("scheduler", "resumeThreshold"),
    ("scheduler", "utilizationThreshold"), ("scheduler", "maxPreemptionsPerTick"), ("scheduler", "pressureSignal"),
    ("gossip",), ("defrag",), ("gpuType",),
)


def _without_empty(value: Any) -> Any:
    """An empty section means the same as an absent one (``scheduler: {}`` once its live keys are gone)."""
    if isinstance(value, Mapping):
        kept = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v != {}}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


def lora_on(spec: Mapping[str, Any]) -> bool:
    """Whether the vLLM engines start with LoRA on: a model has adapters, or ``engineArgs`` sets
    ``enable_lora`` (vLLM fixes it at start; adapters then come and go in the running engine)."""
    runtime = spec.get("runtime") or {}
    if runtime.get("engine", "vllm") != "vllm":
        return False
    return bool((runtime.get("engineArgs") or {}).get("enable_lora")) or any(
        m.get("loras") for m in spec.get("models") or () if isinstance(m, Mapping))


def _hashed_model(model: Mapping[str, Any], spec: Mapping[str, Any]) -> dict:
    """A ``models[]`` entry as the pod depends on it: its source in typed form, and of its LoRA
    adapters only those with a volume of their own (:func:`zerolayer.models.live_adapter`: the others
    load in the running engine) plus whether LoRA is on at all, which vLLM fixes at start (the first
    adapter turns it on unless ``engineArgs.enable_lora`` already did)."""
    adapters = [a for a in model.get("loras") or () if isinstance(a, Mapping)]
    hashed = {k: v for k, v in model.items() if k != "loras"}
    hashed["source"] = model_layout.normalise_source(model.get("source"))
    mounted = [{**a, "source": model_layout.normalise_source(a.get("source"))} for a in adapters
               if not model_layout.live_adapter(a)]
    if mounted:
        hashed["loras"] = mounted
    enabled = bool(((spec.get("runtime") or {}).get("engineArgs") or {}).get("enable_lora"))
    if adapters and not enabled:
        hashed["loraOn"] = True
    return hashed


def runtime_config_hash(spec: Mapping[str, Any]) -> str:
    """Hash of what the runtime pod reads once at start from the InferenceNode spec.

    Put on the pod template (:data:`CONFIG_HASH_ANNOTATION`), it makes a change of models or
    engine settings a template change, which the DaemonSet rolls out (old pod first, which
    drains on SIGTERM). Fields in :data:`LIVE_SPEC_FIELDS` are left out, and so are LoRA adapters the
    runtime loads live (:func:`_hashed_model`). Legacy string sources hash like their typed form, so
    migrating an object does not roll its pod. ``spec.runtime.apiProcesses`` and ``spec.runtime.resources``
    are in it, so a new number of API processes, explicit or following the CPU request, rolls the pod;
    what the operator's own settings change (its default resources) reaches the template through the
    rendered config (:data:`RUNTIME_CONFIG_ANNOTATION`) and the container's resources.
    """
    rest = copy.deepcopy(dict(spec))
    rest["models"] = [_hashed_model(m, rest) for m in rest.get("models") or () if isinstance(m, Mapping)]
    for path in LIVE_SPEC_FIELDS:
        parent: Any = rest
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, Mapping) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    canonical = json.dumps(_without_empty(rest), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- model storage
MODEL_CACHE_VOLUME = "model-cache"
ADAPTERS_VOLUME = "lora-adapters"
HF_TOKEN_MOUNT = "/etc/zerolayer/hf-token"
FETCH_CONTAINER_PREFIX = "fetch-model-"


@dataclasses.dataclass
class ModelStorage:
    """What the pod needs so the server finds every model at its container path
    (:func:`zerolayer.models.container_path`)."""

    volumes: list[dict] = dataclasses.field(default_factory=list)
    server_mounts: list[dict] = dataclasses.field(default_factory=list)
    init_containers: list[dict] = dataclasses.field(default_factory=list)


def _fetch_container(index: int, hf: Mapping[str, Any], image: str, pull: str) -> tuple[dict, list[dict]]:
    """The init container that downloads one huggingFace source into the node cache, and its token volume."""
    args = ["fetch-model", f"--repo={hf['repo']}",
            f"--revision={hf.get('revision') or model_layout.DEFAULT_REVISION}",
            f"--cache-dir={model_layout.CACHE_HOST_DIR}", "--termination-log=/dev/termination-log"]
    if hf.get("endpoint"):
        args.append(f"--endpoint={hf['endpoint']}")
    mounts: list[dict[str, Any]] = [{"name": MODEL_CACHE_VOLUME, "mountPath": model_layout.CACHE_HOST_DIR},
              {"name": "tmp", "mountPath": "/tmp"}]
    volumes = []
    token = hf.get("tokenSecretRef") or {}
    if token.get("name"):
        volume = f"hf-token-{index}"
        volumes.append({"name": volume, "secret": {
            "secretName": token["name"], "defaultMode": 0o400,
            "items": [{"key": token.get("key") or model_layout.DEFAULT_TOKEN_KEY, "path": "token"}]}})
        mounts.append({"name": volume, "mountPath": HF_TOKEN_MOUNT, "readOnly": True})
        args.append(f"--token-file={HF_TOKEN_MOUNT}/token")
    container = {
        "name": f"{FETCH_CONTAINER_PREFIX}{index}",
        "image": image,
        "imagePullPolicy": pull,
        "args": args,
        # huggingface_hub keeps its own state under HF_HOME; the root filesystem is read-only.
        "env": [{"name": "HF_HOME", "value": "/tmp/hf-home"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
        # The one-line reason the fetcher writes shows in `kubectl describe pod`; a crash
        # before it could write falls back to the log's tail.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Root only to write into the node cache, which the kubelet creates root-owned
        # (DirectoryOrCreate); no capabilities, so it cannot touch files it does not own.
        # The fetcher makes what it writes world-readable for the non-root server.
        "securityContext": {
            "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
    }
    return container, volumes


def build_model_storage(spec: Mapping[str, Any], image: str, pull: str) -> ModelStorage:
    """Volumes, server mounts and download containers for ``spec.models`` and their LoRA adapters
    (:func:`zerolayer.models.weight_entries`: models first, then adapters, by index).

    A pod whose engine has LoRA on (:func:`lora_on`) also mounts the node's
    :data:`zerolayer.models.ADAPTERS_HOST_DIR` read-only at the same path: entries there need no
    volume of their own, so adapters put there are added and removed without changing the pod.
    Each other entry's volume is ``model-<index>`` (hostPath ``Directory``, or the PVC read-only);
    huggingFace models share the node cache volume and mount their own cache entry via
    ``subPath``. Every server mount is read-only. ``path`` sources need nothing.
    """
    storage = ModelStorage()
    if lora_on(spec):
        # LoRA adapters put here on the node load into the running engine with no pod change.
        storage.volumes.append(_host_path(ADAPTERS_VOLUME, model_layout.ADAPTERS_HOST_DIR, "DirectoryOrCreate"))
        storage.server_mounts.append({"name": ADAPTERS_VOLUME, "mountPath": model_layout.ADAPTERS_HOST_DIR,
                                      "readOnly": True})
    for index, model in enumerate(model_layout.weight_entries(spec)):
        source = model_layout.normalise_source(model.get("source"))
        kind = model_layout.source_kind(source)
        if kind == "path" or model_layout.under_adapters_dir(source):
            continue
        target = model_layout.container_path(model)
        volume = f"model-{index}"
        if kind == "hostPath":
            storage.volumes.append(_host_path(volume, source["hostPath"]["path"], "Directory"))
            storage.server_mounts.append({"name": volume, "mountPath": target, "readOnly": True})
        elif kind == "pvc":
            pvc = source["pvc"]
            storage.volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": pvc["claimName"],
                                                                                "readOnly": True}})
            mount = {"name": volume, "mountPath": target, "readOnly": True}
            if pvc.get("subPath"):
                mount["subPath"] = pvc["subPath"]
            storage.server_mounts.append(mount)
        else:
            hf = source["huggingFace"]
            if not any(v["name"] == MODEL_CACHE_VOLUME for v in storage.volumes):
                storage.volumes.append(_host_path(MODEL_CACHE_VOLUME, model_layout.CACHE_HOST_DIR,
                                                  "DirectoryOrCreate"))
            container, token_volumes = _fetch_container(index, hf, image, pull)
            storage.init_containers.append(container)
            storage.volumes += token_volumes
            storage.server_mounts.append({
                "name": MODEL_CACHE_VOLUME, "mountPath": target, "readOnly": True,
                "subPath": model_layout.cache_entry(hf["repo"], hf.get("revision"))})
    return storage


def _first_line(text: str | None, limit: int = 512) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]  # the fetcher's reason is its last line


def fetch_progress(pod: Mapping[str, Any], fetches: set[str]) -> tuple[str, str, str] | None:
    """(status, reason, message) of a ModelsReady condition from one runtime pod's
    download containers (names in ``fetches``), or None when every download completed.

    A download container that exited non-zero (now, or before its current restart) is a
    failure, reported with the one-line reason from its termination message.
    """
    pod_name = pod.get("metadata", {}).get("name", "?")
    statuses = {s.get("name"): s for s in (pod.get("status") or {}).get("initContainerStatuses") or ()}
    pending = []
    for name in sorted(fetches):
        status = statuses.get(name) or {}
        state, last = status.get("state") or {}, status.get("lastState") or {}
        for terminated in (state.get("terminated"), last.get("terminated")):
            if terminated and terminated.get("exitCode", 0) != 0:
                why = _first_line(terminated.get("message")) or terminated.get("reason") or "no reason recorded"
                return ("False", "ModelDownloadFailed",
                        f"{name} in pod {pod_name} failed (exit {terminated.get('exitCode')}): {why}")
        if (state.get("terminated") or {}).get("exitCode") == 0:
            continue
        if "running" in state:
            return ("Unknown", "ModelDownloading", f"{name} in pod {pod_name} is downloading")
        pending.append(name)
    if pending:
        return ("Unknown", "ModelDownloadPending", f"{', '.join(pending)} in pod {pod_name} not started yet")
    return None


def model_claims(spec: Mapping[str, Any]) -> list[str]:
    """PersistentVolumeClaims the models and adapters need, in spec order without repeats."""
    claims: list[str] = []
    for model in model_layout.weight_entries(spec):
        source = model_layout.normalise_source(model.get("source"))
        claim = (source.get("pvc") or {}).get("claimName")
        if claim and claim not in claims:
            claims.append(claim)
    return claims


def model_token_secrets(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(Secret name, key) of every huggingFace token the models and adapters need, without repeats."""
    refs: list[tuple[str, str]] = []
    for model in model_layout.weight_entries(spec):
        source = model_layout.normalise_source(model.get("source"))
        ref = (source.get("huggingFace") or {}).get("tokenSecretRef") or {}
        if ref.get("name"):
            pair = (ref["name"], ref.get("key") or model_layout.DEFAULT_TOKEN_KEY)
            if pair not in refs:
                refs.append(pair)
    return refs


# The service-account token, CA and namespace where client libraries look for them, as the
# kubelet's automount would put them, but mounted only into the containers that call the API.
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_ACCESS_VOLUME = {"name": "kube-api-access", "projected": {"defaultMode": 0o444, "sources": [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
]}}
API_ACCESS_MOUNT = {"name": "kube-api-access", "mountPath": SA_DIR, "readOnly": True}
CLICKHOUSE_USER_ENV, CLICKHOUSE_PASSWORD_ENV = "ZEROLAYER_CLICKHOUSE_USER", "ZEROLAYER_CLICKHOUSE_PASSWORD"


def _clickhouse_args(audit: Mapping[str, Any]) -> list[str]:
    """``--clickhouse=URL``; with a credentials Secret the URL carries ``$(VAR)`` references that the
    kubelet expands inside the container, so neither the spec nor ``kubectl describe`` shows them."""
    if audit.get("store") != "clickhouse":
        return []
    url = audit["clickhouseUrl"]
    if (audit.get("clickhouseCredentialsSecretRef") or {}).get("name"):
        scheme, _, rest = url.partition("://")
        url = f"{scheme}://$({CLICKHOUSE_USER_ENV}):$({CLICKHOUSE_PASSWORD_ENV})@{rest}"
    return [f"--clickhouse={url}"]


def _clickhouse_env(audit: Mapping[str, Any]) -> list[dict]:
    ref = audit.get("clickhouseCredentialsSecretRef") or {}
    if audit.get("store") != "clickhouse" or not ref.get("name"):
        return []
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get(key) or default}}}
            for var, key, default in ((CLICKHOUSE_USER_ENV, "usernameKey", "username"),
                                      (CLICKHOUSE_PASSWORD_ENV, "passwordKey", "password"))]


def _probe(path: str, scheme: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": SERVING_PORT_NAME, "scheme": scheme},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def server_resources(spec: Mapping[str, Any], config: OperatorConfig) -> dict:
    """The server container's requests and limits: the operator's ``runtime_resources`` (the chart's
    ``runtime.resources``) overridden by ``spec.runtime.resources``, plus ``nvidia.com/gpu``."""
    runtime = spec.get("runtime") or {}
    return _merge_resources(config.runtime_resources, runtime.get("resources"), int(runtime.get("gpus", 1)))


def runtime_config_text(spec: Mapping[str, Any], config: OperatorConfig) -> str:
    """The runtime's config file for this spec (:data:`RUNTIME_CONFIG_ANNOTATION`): ``server.api_processes``
    from ``spec.runtime.apiProcesses``, else from the server container's CPU request
    (:func:`~.runtime_config.api_processes`)."""
    return rc.runtime_config_text(spec, server_resources(spec, config))


def _server_container(inode: Mapping[str, Any], config: OperatorConfig, env: list[dict],
                      storage: ModelStorage) -> tuple[dict, list[dict]]:
    """The serving container (``spec.runtime.image``) and the volumes of the pod it needs: scratch,
    the audit spool, shared memory, API access, the config file the operator renders
    (:data:`RUNTIME_CONFIG_ANNOTATION`), the models and, with ``tlsSecretName``, its TLS pair."""
    name, spec = inode["metadata"]["name"], inode.get("spec", {})
    runtime, audit = spec.get("runtime") or {}, spec.get("audit") or {}
    port = int(runtime.get("port") or config.runtime_port)
    metrics_port = int(config.runtime_metrics_port)
    tls = runtime.get("tlsSecretName")
    scheme = "HTTPS" if tls else "HTTP"
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "run", "mountPath": "/run/zerolayer"},
              {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "runtime-config", "mountPath": RUNTIME_CONFIG_MOUNT, "readOnly": True}] \
        + storage.server_mounts + [dict(API_ACCESS_MOUNT)]
    volumes: list[dict] = [
        {"name": "tmp", "emptyDir": {}},
        # The audit spool (journal segments, counters). The auditor deletes consumed segments; the limit
        # bounds what a stalled auditor can pile up on the node's disk (past it the kubelet evicts the pod).
        {"name": "run", "emptyDir": {"sizeLimit": AUDIT_SPOOL_LIMIT}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}},
        # The pod's own annotation as a file: no ConfigMap to write, and the file is what the template says.
        {"name": "runtime-config", "downwardAPI": {"items": [
            {"path": RUNTIME_CONFIG_FILE.rsplit("/", 1)[1],
             "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{RUNTIME_CONFIG_ANNOTATION}']"}}]}},
        API_ACCESS_VOLUME,
    ] + storage.volumes
    if tls:
        # The runtime reads tls.crt and tls.key from here (TLS_DIR in runtime/node/incluster.py).
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": tls}})
    container = {
        "name": "server",
        "image": runtime.get("image") or config.runtime_image,
        "imagePullPolicy": runtime.get("imagePullPolicy") or config.runtime_image_pull_policy,
        # --in-cluster: the InferenceNode laid over the rendered config file (a --config alone would not read it).
        "args": ["runtime", f"--node-name={name}", "--in-cluster", f"--config={RUNTIME_CONFIG_FILE}",
                 f"--port={port}", f"--metrics-port={metrics_port}", f"--audit-spool={AUDIT_SPOOL}"]
        # auto falls back to the journal when BPF cannot run: the journal must then exist.
        + (["--audit-journal"] if audit.get("mode", "auto") in ("auto", "inprocess") else []),
        # The server only reads models from its mounts: never reach out to a hub.
        "env": env + [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "ports": [{"name": SERVING_PORT_NAME, "containerPort": port, "protocol": "TCP"},
                  {"name": METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"}],
        # Model loading can take minutes; the startup probe holds liveness off until then.
        "startupProbe": _probe("/healthz", scheme, 10, 60),
        "readinessProbe": _probe("/readyz", scheme, 5, 2),
        "livenessProbe": _probe("/healthz", scheme, 10, 3),
        "resources": server_resources(spec, config),
        "securityContext": dict(_NON_ROOT),
        "volumeMounts": mounts,
    }
    return container, volumes


def _holds_every_gpu(inode: Mapping[str, Any], node_gpus: int | None) -> bool:
    """Whether the runtime holds every GPU of its node: only then may a sidecar see ``all`` of them
    through NVML (it cannot share the server's device-plugin allocation), and see nothing else's."""
    gpus = int(((inode.get("spec") or {}).get("runtime") or {}).get("gpus", 1))
    return node_gpus is not None and gpus >= node_gpus > 0


_NVML_ONLY_ENV = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                  {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"}]


def _defragd_container(inode: Mapping[str, Any], config: OperatorConfig, env: list[dict],
                       node_gpus: int | None) -> tuple[dict, list[dict]] | None:
    """The GPU defragmenter (the operator's image), or None when disabled or when the runtime does not
    hold every GPU of the node (a sidecar cannot share the server's device-plugin allocation, and
    ``NVIDIA_VISIBLE_DEVICES=all`` would otherwise show it other pods' GPUs). It needs no volume of
    its own."""
    spec = inode.get("spec", {})
    defrag = spec.get("defrag") or {}
    if not (defrag.get("enabled", True) and _holds_every_gpu(inode, node_gpus)):
        return None
    security = dict(_NON_ROOT)
    if defrag.get("allowReset"):
        # A GPU reset goes through the driver's privileged ioctl: root with SYS_ADMIN,
        # granted only when the InferenceNode explicitly allows resets.
        security.update(runAsNonRoot=False, runAsUser=0, runAsGroup=0,
                        capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]})
    return {
        "name": "defragd",
        "image": config.runtime_image,
        "imagePullPolicy": config.runtime_image_pull_policy,
        "args": ["defragd", f"--node-name={inode['metadata']['name']}"]
        + (["--dry-run"] if defrag.get("dryRun") else []),
        # NVML only (no compute); same UID as the server, so with the shared process
        # namespace it can signal the pod's own processes and nothing else. "all" is
        # exactly the server's allocation here: the runtime holds every GPU of the node.
        "env": env + [dict(e) for e in _NVML_ONLY_ENV],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": security,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, dict(API_ACCESS_MOUNT)],
    }, []


_AUDITOR_MOUNTS: list[dict[str, Any]] = [
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "run", "mountPath": "/run/zerolayer"},
    {"name": "tracefs", "mountPath": "/sys/kernel/tracing"},
    {"name": "bpffs", "mountPath": "/sys/fs/bpf"},
    {"name": "modules", "mountPath": "/lib/modules", "readOnly": True},
    {"name": "usr-src", "mountPath": "/usr/src", "readOnly": True},
    {"name": "audit", "mountPath": "/var/lib/zerolayer/audit"},
    {"name": "cgroup", "mountPath": "/host/sys/fs/cgroup", "readOnly": True},
]


DEFAULT_ELECTRICITY_PRICE_PER_KWH = "0.15"  # the CRD's default for spec.audit.electricityPricePerKWh


def _auditor_container(inode: Mapping[str, Any], config: OperatorConfig, env: list[dict],
                       node_kernel: str | None, node_gpus: int | None = None) -> tuple[dict, list[dict]] | None:
    """The usage auditor (the operator's image, root with the BPF capabilities the node's kernel
    needs) and the host paths it reads, or None when auditing is off.

    Energy: the electricity price is ``spec.audit.electricityPricePerKWh``; the GPUs' power comes
    from NVML when the runtime holds every GPU of the node (:func:`_holds_every_gpu`, as for
    defragd: otherwise NVML would show other pods' GPUs and bill their power here), else there is
    no energy part in ``status.usage.cost``."""
    audit = inode.get("spec", {}).get("audit") or {}
    if not audit.get("enabled", True):
        return None
    price = str(audit.get("electricityPricePerKWh") or DEFAULT_ELECTRICITY_PRICE_PER_KWH)
    nvml = _holds_every_gpu(inode, node_gpus)
    volumes = [
        _host_path("tracefs", "/sys/kernel/tracing", "Directory"),
        _host_path("bpffs", "/sys/fs/bpf", "DirectoryOrCreate"),
        _host_path("modules", "/lib/modules", "Directory"),
        _host_path("usr-src", "/usr/src", "Directory"),
        _host_path("audit", "/var/lib/zerolayer/audit", "DirectoryOrCreate"),
        _host_path("cgroup", "/sys/fs/cgroup", "Directory"),
    ]
    return {
        "name": "auditor",
        "image": config.runtime_image,
        "imagePullPolicy": config.runtime_image_pull_policy,
        # Meter this pod's runtime only: its cgroup, found from the pod's UID in the host's cgroup tree.
        "args": ["auditor", f"--source={AUDIT_SOURCES[audit.get('mode', 'auto')]}",
                 f"--spool={AUDIT_SPOOL}", f"--db={AUDIT_DB}", "--tenant-quotas",
                 "--pod-uid=$(POD_UID)", "--cgroup-root=/host/sys/fs/cgroup",
                 f"--retention={int(audit.get('retentionDays', 30))}d",
                 f"--gpu-source={'auto' if nvml else 'none'}", f"--energy-price-per-kwh={price}",
                 # the mode it meters in, and why, as an Event on this pod (kubectl describe)
                 "--mode-event-pod=$(POD_NAMESPACE)/$(POD_NAME)", f"--metrics-port={AUDIT_METRICS_PORT}"]
        + _clickhouse_args(audit),
        "ports": [{"name": AUDIT_METRICS_PORT_NAME, "containerPort": AUDIT_METRICS_PORT, "protocol": "TCP"}],
        "env": env + [{"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}}]
        + _clickhouse_env(audit) + ([dict(e) for e in _NVML_ONLY_ENV] if nvml else []),
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {
            "privileged": False,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": auditor_capabilities(node_kernel, config.auditor_kernel_mode)},
            # bpf() and perf_event_open() are outside the RuntimeDefault profile's allow list.
            "seccompProfile": {"type": "Unconfined"},
        },
        "volumeMounts": [dict(mount) for mount in _AUDITOR_MOUNTS] + [dict(API_ACCESS_MOUNT)],
    }, volumes


def _runtime_pod_spec(inode: Mapping[str, Any], init_containers: list[dict], containers: list[dict],
                      volumes: list[dict]) -> dict:
    """The runtime pod: its own ServiceAccount, a shared process namespace, pinned to ``spec.nodeName``."""
    spec = inode.get("spec", {})
    drain = int((spec.get("runtime") or {}).get("drainSeconds", 120))
    return {
        "serviceAccountName": runtime_name(inode["metadata"]["name"]),
        # The token goes only where the API is called (API_ACCESS_MOUNT in server,
        # defragd and auditor), not into the model downloads.
        "automountServiceAccountToken": False,
        # defragd signals idle engine processes in this pod only.
        "shareProcessNamespace": True,
        # SIGTERM starts the drain; the kubelet waits this long before SIGKILL.
        "terminationGracePeriodSeconds": drain + 10,
        "nodeSelector": {INFERENCE_NODE_LABEL: "true"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [spec["nodeName"]]}]}
                    ]
                }
            }
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {"fsGroup": RUNTIME_UID},
        "initContainers": init_containers,
        "containers": containers,
        "volumes": volumes,
    }


def build_daemonset(inode: Mapping[str, Any], config: OperatorConfig, node_gpus: int | None = None,
                    node_kernel: str | None = None) -> dict:
    """The runtime workload of one InferenceNode: a DaemonSet that lands on exactly its node.

    Only the ``server`` container runs ``spec.runtime.image``: the containers with root or
    extra capabilities (auditor, defragd, model downloads) run the operator's configured image,
    so writing InferenceNodes does not mean choosing what runs with BPF and ptrace on the node.
    ``node_gpus`` is the Node's allocatable ``nvidia.com/gpu`` (:func:`_defragd_container`);
    ``node_kernel`` its ``status.nodeInfo.kernelVersion``, which decides the auditor's
    capabilities (:func:`auditor_capabilities`). Each container comes with the volumes it needs.

    One DaemonSet per InferenceNode (not one for all): images, resources, GPU count and
    drain time come from each InferenceNode's spec, and each pod runs as its own
    ServiceAccount so RBAC can limit status writes to its own InferenceNode. The node
    selector requires the operator's label, so unlabelling the node (deletion) removes the
    pod, and node affinity on ``metadata.name`` pins it to ``spec.nodeName``.
    """
    name = inode["metadata"]["name"]
    spec = inode.get("spec", {})
    selector = runtime_selector(name)
    env = _downward_env(name)
    storage = build_model_storage(spec, config.runtime_image, config.runtime_image_pull_policy)
    parts = [_server_container(inode, config, env, storage), _defragd_container(inode, config, env, node_gpus),
             _auditor_container(inode, config, env, node_kernel, node_gpus)]
    containers = [container for container, _ in filter(None, parts)]
    volumes = [volume for _, volumes in filter(None, parts) for volume in volumes]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {**_meta(runtime_name(name), config.runtime_namespace, inode, OWNER_NODE_LABEL),
                     "labels": {**MANAGED_BY, **selector}},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": {**MANAGED_BY, **selector, **model_labels(base_model_names(spec))},
                    "annotations": {OWNER_NAME_ANNOTATION: f"InferenceNode/{name}",
                                    CONFIG_HASH_ANNOTATION: runtime_config_hash(spec),
                                    RUNTIME_CONFIG_ANNOTATION: runtime_config_text(spec, config),
                                    AUDITOR_KERNEL_MODE_ANNOTATION: str(config.auditor_kernel_mode).lower()},
                },
                "spec": _runtime_pod_spec(inode, storage.init_containers, containers, volumes),
            },
        },
    }


def build_serviceaccount(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """The runtime pod's identity (one per InferenceNode, see :func:`build_clusterrole`)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(runtime_name(inode["metadata"]["name"]), config.runtime_namespace, inode, OWNER_NODE_LABEL),
    }


def build_clusterrole(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Least privilege for one runtime pod.

    Patch the status of its own InferenceNode only (``resourceNames``), read every
    InferenceNode (the GPU-map gossip) and every TenantQuota (policies), and patch TenantQuota
    status (the auditor's ``status.usage``: one pod has one account, so this is the server's
    too; docs/security.md finding 5). No Secret: the key hashes come through
    :func:`build_keys_role`, in the runtime namespace only.
    """
    name = inode["metadata"]["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": _meta(runtime_name(name), None, inode, OWNER_NODE_LABEL),
        "rules": [
            {"apiGroups": [GROUP], "resources": ["inferencenodes"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [GROUP], "resources": ["inferencenodes/status"], "resourceNames": [name],
             "verbs": ["get", "patch"]},
            {"apiGroups": [GROUP], "resources": ["tenantquotas"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [GROUP], "resources": ["tenantquotas/status"], "verbs": ["get", "patch"]},
            # gossip and defragd record what they do as Events on the InferenceNode
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ],
    }


def build_clusterrolebinding(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    child = runtime_name(inode["metadata"]["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": _meta(child, None, inode, OWNER_NODE_LABEL),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": config.runtime_namespace}],
    }


def build_headless_service(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """DNS for the runtime pod: ``zl-runtime-<name>.<namespace>.svc`` resolves to its IP."""
    name = inode["metadata"]["name"]
    port = int((inode.get("spec", {}).get("runtime") or {}).get("port") or config.runtime_port)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(runtime_name(name), config.runtime_namespace, inode, OWNER_NODE_LABEL),
        "spec": {
            "clusterIP": "None",
            "selector": runtime_selector(name),
            "ports": [{"name": SERVING_PORT_NAME, "port": port, "targetPort": SERVING_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def _namespace_peer(namespaces) -> dict:
    return {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(set(namespaces))}]}}


LINK_LOCAL = ("169.254.0.0/16", "fe80::/10")  # cloud metadata endpoints live here


def _anywhere_but_link_local() -> list[dict]:
    return [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [LINK_LOCAL[0]]}},
            {"ipBlock": {"cidr": "::/0", "except": [LINK_LOCAL[1]]}}]


def _url_port(url: str, default_http: int, default_https: int) -> int:
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    return port or (default_https if parsed.scheme == "https" else default_http)


def _egress_rules(spec: Mapping[str, Any], config: OperatorConfig) -> list[dict]:
    """Where a runtime pod may connect: DNS, the API server (its own addresses and ports: CNIs match
    egress after the ``kubernetes`` Service's DNAT), ClickHouse when it is the audit store,
    the model hub when a model is downloaded. Never link-local addresses (the metadata endpoint)."""
    api = [{"ipBlock": {"cidr": c}} for c in config.api_server_cidrs] or _anywhere_but_link_local()
    rules: list[dict] = [
        {"to": [{"namespaceSelector": {}}], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"to": api, "ports": [{"protocol": "TCP", "port": int(p)} for p in config.api_server_ports]},
    ]
    audit = spec.get("audit") or {}
    if audit.get("store") == "clickhouse" and audit.get("clickhouseUrl"):
        rules.append({"to": _anywhere_but_link_local(),
                      "ports": [{"protocol": "TCP", "port": _url_port(audit["clickhouseUrl"], 8123, 8443)}]})
    hubs = sorted({_url_port(model_layout.normalise_source(m.get("source"))["huggingFace"].get("endpoint")
                             or "https://hub", 80, 443)
                   for m in model_layout.weight_entries(spec)
                   if model_layout.source_kind(model_layout.normalise_source(m.get("source"))) == "huggingFace"})
    if hubs:
        rules.append({"to": _anywhere_but_link_local(), "ports": [{"protocol": "TCP", "port": p} for p in hubs]})
    return rules


def build_runtime_networkpolicy(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Isolate one runtime pod.

    Ingress: the operator's namespace reaches the serving port, the metrics scrapers' namespaces
    the metrics port only (per-tenant names and volumes live there). Tenants' policies
    (:func:`build_tenant_networkpolicy`) add serving for their namespaces; NetworkPolicies only ever
    add allowances, so everything else stays refused. Egress: :func:`_egress_rules`.
    """
    name = inode["metadata"]["name"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(runtime_name(name), config.runtime_namespace, inode, OWNER_NODE_LABEL),
        "spec": {
            "podSelector": {"matchLabels": runtime_selector(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [_namespace_peer([config.operator_namespace])],
                         "ports": [{"protocol": "TCP", "port": SERVING_PORT_NAME}]},
                        {"from": [_namespace_peer(config.metrics_scraper_namespaces)],
                         "ports": [{"protocol": "TCP", "port": METRICS_PORT_NAME},
                                   {"protocol": "TCP", "port": AUDIT_METRICS_PORT_NAME}]}],
            "egress": _egress_rules(inode.get("spec") or {}, config),
        },
    }


def build_keys_role(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Read access to the fleet's key hashes (:data:`TENANT_KEYS_SECRET`) and no other Secret."""
    name = inode["metadata"]["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(runtime_name(name), config.runtime_namespace, inode, OWNER_NODE_LABEL),
        # list/watch by name (a metadata.name field selector is authorised by resourceNames): runtimes watch it
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [TENANT_KEYS_SECRET],
                   "verbs": ["get", "list", "watch"]}],
    }


def build_keys_rolebinding(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Bind :func:`build_keys_role` to this runtime's ServiceAccount, by name: no other account
    of the runtime namespace (``default``, say) can read the hashes."""
    child = runtime_name(inode["metadata"]["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(child, config.runtime_namespace, inode, OWNER_NODE_LABEL),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": config.runtime_namespace}],
    }


# --------------------------------------------------------------------------- TenantQuota
def secret_ref(tquota: Mapping[str, Any], config: OperatorConfig) -> tuple[str, str, str]:
    """(namespace, name, key) of the tenant's API-key Secret, with the CRD's defaults."""
    ref = tquota.get("spec", {}).get("apiKeySecretRef") or {}
    return (ref.get("namespace") or config.runtime_namespace, ref.get("name", ""),
            ref.get("key") or DEFAULT_SECRET_KEY)


def secret_namespace_allowed(tquota: Mapping[str, Any], config: OperatorConfig) -> bool:
    """Whether the API-key Secret's namespace is one the TenantQuota may name: one of the
    tenant's own ``spec.namespaces``, the runtime namespace, or the operator's
    ``tenant_secret_namespaces`` allow-list. Anything else (``kube-system``...) would let
    whoever writes TenantQuotas make the operator read, and report on, someone else's Secret."""
    namespace = secret_ref(tquota, config)[0]
    spec = tquota.get("spec") or {}
    return namespace in {config.runtime_namespace, *(spec.get("namespaces") or ()), *config.tenant_secret_namespaces}


def key_hashes(text: str) -> list[str]:
    """SHA-256 hex digests of the keys in one Secret entry (one key per line), sorted, no repeats.

    The same digest as ``zerolayer.runtime.tenants.key_hash`` (the operator does not import the
    runtime; tests/unit/operator checks they agree)."""
    return sorted({hashlib.sha256(line.strip().encode()).hexdigest() for line in text.splitlines() if line.strip()})


def build_tenant_key_entry(tquota: Mapping[str, Any], hashes: list[str]) -> str:
    """The TenantQuota's data entry in :data:`TENANT_KEYS_SECRET`: base64 of
    ``{"tenant", "created", "hashes"}``. ``created`` lets every reader pick the same winner when
    two quotas claim one tenant name or one key (the older one)."""
    meta = tquota["metadata"]
    document = {"tenant": tquota["spec"]["tenant"], "created": meta.get("creationTimestamp") or "",
                "hashes": sorted(hashes)}
    return base64.b64encode(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).decode()


def read_tenant_key_entry(raw: str) -> dict[str, Any] | None:
    """One entry of :data:`TENANT_KEYS_SECRET` decoded, or None when it does not decode."""
    try:
        document = json.loads(base64.b64decode(raw).decode())
        return {"tenant": str(document["tenant"]), "created": str(document.get("created") or ""),
                "hashes": [str(h) for h in document["hashes"]]}
    except (ValueError, KeyError, TypeError):
        return None


def build_tenant_keys_secret(namespace: str) -> dict:
    """The fleet's Secret of key hashes, empty; entries are merge-patched in per TenantQuota.

    Not owned by any one object: it outlives every TenantQuota. A Secret rather than a
    ConfigMap so that roles which may read ConfigMaps do not get unsalted key hashes."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": TENANT_KEYS_SECRET, "namespace": namespace,
                         "labels": dict(MANAGED_BY)}, "data": {}}


def build_tenant_networkpolicy(tquota: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Let the tenant's namespaces reach every runtime's serving port (and nothing else)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(tenant_name(tquota["metadata"]["name"]), config.runtime_namespace, tquota,
                          OWNER_TENANT_LABEL),
        "spec": {
            "podSelector": {"matchLabels": {APP_LABEL: RUNTIME_APP}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [_namespace_peer(tquota["spec"]["namespaces"])],
                         "ports": [{"protocol": "TCP", "port": SERVING_PORT_NAME}]}],
        },
    }


def build_ciliumnetworkpolicy(tquota: Mapping[str, Any], config: OperatorConfig) -> dict:
    """L7 variant of the tenant policy, for clusters running Cilium.

    From the tenant's namespaces, only HTTP requests that carry an API key (``x-api-key``
    or ``authorization``) reach the serving port; the runtime then authenticates the key
    itself. It replaces the tenant's plain NetworkPolicy rather than adding to it: Cilium
    merges an L4-only allowance for the same peer and port into "any HTTP", which would
    void the header rule.
    """
    return {
        "apiVersion": CILIUM_API_VERSION,
        "kind": "CiliumNetworkPolicy",
        "metadata": _meta(tenant_name(tquota["metadata"]["name"]), config.runtime_namespace, tquota,
                          OWNER_TENANT_LABEL),
        "spec": {
            "endpointSelector": {"matchLabels": {APP_LABEL: RUNTIME_APP}},
            "ingress": [{
                "fromEndpoints": [{"matchLabels": {"k8s:io.kubernetes.pod.namespace": ns}}
                                  for ns in sorted(set(tquota["spec"]["namespaces"]))],
                "toPorts": [{
                    "ports": [{"port": SERVING_PORT_NAME, "protocol": "TCP"}],
                    "rules": {"http": [{"headers": [h]} for h in API_KEY_HEADERS]},
                }],
            }],
        },
    }
