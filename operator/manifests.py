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
- per TenantQuota: NetworkPolicy (or, with Cilium, a CiliumNetworkPolicy) in the runtime
  namespace, Role and RoleBinding in the API-key Secret's namespace, all ``zl-tenant-<name>``
  and owned by the TenantQuota.
- Node labels cannot be owned: the InferenceNode's finalizer removes them.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any, Mapping

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

SERVING_PORT_NAME = "serving"  # containerPort name; policies use it so per-node ports need no lookup
RUNTIME_UID = 65532

CILIUM_CRD = "ciliumnetworkpolicies.cilium.io"
CILIUM_API_VERSION = "cilium.io/v2"
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
AUDIT_DB = "/var/lib/zerolayer/audit/audit.db"
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


def _host_path(name: str, path: str, kind: str) -> dict:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def build_daemonset(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """The runtime workload of one InferenceNode: a DaemonSet that lands on exactly its node.

    One DaemonSet per InferenceNode (not one for all): images, resources, GPU count and
    drain time come from each InferenceNode's spec, and each pod runs as its own
    ServiceAccount so RBAC can limit status writes to its own InferenceNode. The node
    selector requires the operator's label, so unlabelling the node (deletion) removes the
    pod, and node affinity on ``metadata.name`` pins it to ``spec.nodeName``.
    """
    name = inode["metadata"]["name"]
    spec = inode.get("spec", {})
    runtime = spec.get("runtime") or {}
    defrag = spec.get("defrag") or {}
    audit = spec.get("audit") or {}
    child = runtime_name(name)
    selector = runtime_selector(name)
    image = runtime.get("image") or config.runtime_image
    pull = runtime.get("imagePullPolicy") or config.runtime_image_pull_policy
    port = int(runtime.get("port") or config.runtime_port)
    gpus = int(runtime.get("gpus", 1))
    drain = int(runtime.get("drainSeconds", 120))
    tls = runtime.get("tlsSecretName")
    env = _downward_env(name)
    scheme = "HTTPS" if tls else "HTTP"

    def probe(path: str, period: int, failures: int) -> dict:
        return {
            "httpGet": {"path": path, "port": SERVING_PORT_NAME, "scheme": scheme},
            "periodSeconds": period,
            "timeoutSeconds": 2,
            "failureThreshold": failures,
        }

    server_mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "run", "mountPath": "/run/zerolayer"}]
    volumes: list[dict] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "run", "emptyDir": {}},
    ]
    if tls:
        server_mounts.append({"name": "tls", "mountPath": "/etc/zerolayer/tls", "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": tls}})

    containers = [
        {
            "name": "server",
            "image": image,
            "imagePullPolicy": pull,
            "args": ["runtime", f"--node-name={name}", f"--port={port}", f"--audit-spool={AUDIT_SPOOL}"]
            + (["--audit-journal"] if audit.get("mode") == "inprocess" else []),
            "env": env,
            "ports": [{"name": SERVING_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
            # Model loading can take minutes; the startup probe holds liveness off until then.
            "startupProbe": probe("/healthz", 10, 60),
            "readinessProbe": probe("/readyz", 5, 2),
            "livenessProbe": probe("/healthz", 10, 3),
            "resources": _merge_resources(config.runtime_resources, runtime.get("resources"), gpus),
            "securityContext": dict(_NON_ROOT),
            "volumeMounts": server_mounts,
        }
    ]
    if defrag.get("enabled", True):
        defrag_security = dict(_NON_ROOT)
        if defrag.get("allowReset"):
            # A GPU reset goes through the driver's privileged ioctl: root with SYS_ADMIN,
            # granted only when the InferenceNode explicitly allows resets.
            defrag_security.update(runAsNonRoot=False, runAsUser=0, runAsGroup=0,
                                   capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]})
        containers.append(
            {
                "name": "defragd",
                "image": image,
                "imagePullPolicy": pull,
                "args": ["defragd", f"--node-name={name}"]
                + (["--dry-run"] if defrag.get("dryRun") else []),
                # NVML only (no compute); same UID as the server, so with the shared process
                # namespace it can signal the pod's own processes and nothing else.
                "env": env + [
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                    {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
                ],
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": defrag_security,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        )
    if audit.get("enabled", True):
        volumes += [
            _host_path("tracefs", "/sys/kernel/tracing", "Directory"),
            _host_path("bpffs", "/sys/fs/bpf", "DirectoryOrCreate"),
            _host_path("modules", "/lib/modules", "Directory"),
            _host_path("usr-src", "/usr/src", "Directory"),
            _host_path("audit", "/var/lib/zerolayer/audit", "DirectoryOrCreate"),
            _host_path("cgroup", "/sys/fs/cgroup", "Directory"),
        ]
        containers.append(
            {
                "name": "auditor",
                "image": image,
                "imagePullPolicy": pull,
                # Meter this pod's runtime only: its cgroup, found from the pod's UID in the host's cgroup tree.
                "args": ["auditor", f"--source={AUDIT_SOURCES[audit.get('mode', 'auto')]}",
                         f"--spool={AUDIT_SPOOL}", f"--db={AUDIT_DB}", "--tenant-quotas",
                         "--pod-uid=$(POD_UID)", "--cgroup-root=/host/sys/fs/cgroup"]
                + ([f"--clickhouse={audit['clickhouseUrl']}"] if audit.get("store") == "clickhouse" else []),
                "env": env + [{"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                             "fieldPath": "metadata.uid"}}}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                "securityContext": {
                    "privileged": False,
                    "runAsNonRoot": False,
                    "runAsUser": 0,
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"], "add": list(AUDITOR_CAPABILITIES)},
                    # bpf() and perf_event_open() are outside the RuntimeDefault profile's allow list.
                    "seccompProfile": {"type": "Unconfined"},
                },
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "run", "mountPath": "/run/zerolayer"},
                    {"name": "tracefs", "mountPath": "/sys/kernel/tracing"},
                    {"name": "bpffs", "mountPath": "/sys/fs/bpf"},
                    {"name": "modules", "mountPath": "/lib/modules", "readOnly": True},
                    {"name": "usr-src", "mountPath": "/usr/src", "readOnly": True},
                    {"name": "audit", "mountPath": "/var/lib/zerolayer/audit"},
                    {"name": "cgroup", "mountPath": "/host/sys/fs/cgroup", "readOnly": True},
                ],
            }
        )

    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {**_meta(child, config.runtime_namespace, inode, OWNER_NODE_LABEL),
                     "labels": {**MANAGED_BY, **selector}},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": {**MANAGED_BY, **selector},
                    "annotations": {OWNER_NAME_ANNOTATION: f"InferenceNode/{name}"},
                },
                "spec": {
                    "serviceAccountName": child,
                    "automountServiceAccountToken": True,
                    # defragd signals idle engine processes in this pod only.
                    "shareProcessNamespace": True,
                    # SIGTERM starts the drain; the kubelet waits this long before SIGKILL.
                    "terminationGracePeriodSeconds": drain + 10,
                    "nodeSelector": {INFERENCE_NODE_LABEL: "true"},
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchFields": [{"key": "metadata.name", "operator": "In",
                                                      "values": [spec["nodeName"]]}]}
                                ]
                            }
                        }
                    },
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "securityContext": {"fsGroup": RUNTIME_UID},
                    "containers": containers,
                    "volumes": volumes,
                },
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
    InferenceNode (the GPU-map gossip) and every TenantQuota (effective quotas), and patch
    TenantQuota status (the auditor's ``status.usage``). API-key Secrets come from the
    per-tenant Role (:func:`build_secret_role`).
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


def build_runtime_networkpolicy(inode: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Isolate one runtime pod: only the operator's and the metrics scrapers' namespaces reach
    its serving port. Tenants' policies (:func:`build_tenant_networkpolicy`) add to this;
    NetworkPolicies only ever add allowances, so everything else stays refused."""
    name = inode["metadata"]["name"]
    peers = {config.operator_namespace, *config.metrics_scraper_namespaces}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(runtime_name(name), config.runtime_namespace, inode, OWNER_NODE_LABEL),
        "spec": {
            "podSelector": {"matchLabels": runtime_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [_namespace_peer(peers)],
                         "ports": [{"protocol": "TCP", "port": SERVING_PORT_NAME}]}],
        },
    }


# --------------------------------------------------------------------------- TenantQuota
def secret_ref(tquota: Mapping[str, Any], config: OperatorConfig) -> tuple[str, str, str]:
    """(namespace, name, key) of the tenant's API-key Secret, with the CRD's defaults."""
    ref = tquota.get("spec", {}).get("apiKeySecretRef") or {}
    return ref.get("namespace") or config.runtime_namespace, ref.get("name", ""), ref.get("key") or "api-keys"


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


def build_secret_role(tquota: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Read access to exactly the tenant's API-key Secret, in the Secret's namespace."""
    namespace, secret, _key = secret_ref(tquota, config)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(tenant_name(tquota["metadata"]["name"]), namespace, tquota, OWNER_TENANT_LABEL),
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret],
                   "verbs": ["get", "list", "watch"]}],
    }


def build_secret_rolebinding(tquota: Mapping[str, Any], config: OperatorConfig) -> dict:
    """Bind :func:`build_secret_role` to every service account of the runtime namespace.

    A group subject instead of one subject per runtime keeps this object independent of the
    number of GPU nodes (200 nodes x 1,000 tenants would otherwise be 200,000 subjects to
    keep in step). The price: the runtime namespace must hold only runtimes.
    """
    namespace, _secret, _key = secret_ref(tquota, config)
    child = tenant_name(tquota["metadata"]["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(child, namespace, tquota, OWNER_TENANT_LABEL),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                      "name": f"system:serviceaccounts:{config.runtime_namespace}"}],
    }
