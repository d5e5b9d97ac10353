"""What the operator itself may do: the exact RBAC rules its handlers and kopf use.

One source of truth for the Helm chart's operator ClusterRole and Role (docs/operator.md
renders them) and for the e2e test that runs the operator under exactly these rules.
Each rule says why it is needed. Pure data.
"""

from __future__ import annotations

from zerolayer.operator.manifests import TENANT_KEYS_SECRET

DEFAULT_LEASE_NAME = "zerolayer-operator"  # config.OperatorConfig.lease_name

# Cluster-wide (ClusterRole bound to the operator's ServiceAccount).
CLUSTER_RULES: list[dict] = [
    # kopf watches both kinds and patches them (finalizer, progress annotations).
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencenodes", "tenantquotas"],
     "verbs": ["get", "list", "watch", "patch"]},
    # Conditions and phase; get+patch are also what the operator grants runtimes on status.
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencenodes/status", "tenantquotas/status"],
     "verbs": ["get", "patch"]},
    # InferenceFleets (fleet.py): kopf watches them, the autoscaler patches spec.replicas, the operator
    # writes their status and creates and deletes the InferenceNodes each one owns.
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencefleets"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencefleets/status"], "verbs": ["get", "patch"]},
    {"apiGroups": ["zerolayer.io"], "resources": ["inferencenodes"], "verbs": ["create", "delete"]},
    # Read and label GPU nodes; list+watch one Node by name while an InferenceNode waits for it to join.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
    # get only: read each TenantQuota's API-key Secret to count its keys and publish their hashes.
    # Nothing lists or watches Secrets, and runtimes are granted no tenant Secret at all. Not
    # narrowed by resourceNames: the names come from TenantQuotas created after the chart is
    # installed, anywhere in the tenants' namespaces, and RBAC names are fixed when granted.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    # Our Events (core v1), and kopf's warnings.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Is Cilium's CRD installed, and watch for it being installed or removed (every TenantQuota's
    # policy changes kind then). kopf's own CRD and namespace scanning stays off (handlers.configure).
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["get", "list", "watch"]},
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
    # The per-model InferencePools (model_endpoints.py), made only with inference_pools on; granted always,
    # like Cilium's kind, so turning the value on needs no RBAC change. list: the sync reads the existing ones.
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["get", "list", "create", "patch", "delete"]},
    # The fleet's Secret of key hashes (zl-tenant-keys): created once (RBAC cannot name the object
    # a create makes, so create is namespace-wide), entries merge-patched per tenant: patch by name only.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # list/watch by name too: not used by the operator, but each runtime's key-hash Role grants them
    # (runtimes watch that one Secret) and RBAC only lets the operator grant what it holds.
    {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [TENANT_KEYS_SECRET],
     "verbs": ["patch", "list", "watch"]},
    # Does the claim a model source names exist (the runtime pod is held back until it does).
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
    # A failed model download shows only in the runtime pod's init-container status.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]


def operator_namespace_rules(lease_name: str = DEFAULT_LEASE_NAME) -> list[dict]:
    """In the operator's own namespace (Role): the leader-election Lease (operator/leader.py).
    get/update only on that Lease by name; create cannot be narrowed by name (RBAC checks it
    before the object exists), so it is namespace-wide, in the operator's namespace only."""
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [lease_name],
         "verbs": ["get", "update"]},
    ]
