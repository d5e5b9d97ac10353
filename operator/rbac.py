"""What the operator itself may do: the exact RBAC rules its handlers and kopf use.

One source of truth for the Helm chart's operator ClusterRole and Role (docs/operator.md
renders them) and for the e2e test that runs the operator under exactly these rules.
Each rule says why it is needed. Pure data.
"""

from __future__ import annotations

# Cluster-wide (ClusterRole bound to the operator's ServiceAccount).
CLUSTER_RULES: list[dict] = [
    # kopf watches both kinds and patches them (finalizer, progress annotations).
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencenodes", "tenantquotas"],
     "verbs": ["get", "list", "watch", "patch"]},
    # Conditions and phase; get+patch are also what the operator grants runtimes on status.
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencenodes/status", "tenantquotas/status"],
     "verbs": ["get", "patch"]},
    # Read and label GPU nodes; watch them to notice a removed label or a Node that appears.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
    # get only: read each TenantQuota's API-key Secret to count its keys and publish their hashes.
    # Nothing lists or watches Secrets, and runtimes are granted no tenant Secret at all.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    # Our Events (core v1), and kopf's warnings.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Is Cilium's CRD installed (kopf's CRD and namespace scanning is off, see handlers.configure).
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get"]},
    # Each runtime's ClusterRole/Binding (patch its own InferenceNode status, read TenantQuotas).
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles", "clusterrolebindings"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # delete only: remove the per-tenant Role/RoleBinding that older versions created next to each
    # tenant's Secret (runtimes read hashes now, docs/security.md finding 5).
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": ["delete"]},
]

# In the runtime namespace only (Role bound to the operator's ServiceAccount).
RUNTIME_NAMESPACE_RULES: list[dict] = [
    {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["serviceaccounts", "services"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # list/watch here: the operator watches its children in this namespace to repair deletions at once.
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["cilium.io"], "resources": ["ciliumnetworkpolicies"], "verbs": ["get", "create", "patch", "delete"]},
    # The fleet's Secret of key hashes (zl-tenant-keys): created once, entries merge-patched per tenant.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "patch"]},
    # Does the claim a model source names exist (the runtime pod is held back until it does).
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
    # A failed model download shows only in the runtime pod's init-container status.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]
