"""Pure planning: what one reconcile should make true, decided from plain facts.

``plan_inference_node`` and ``plan_tenant_quota`` take the facts the reconciler gathered (the custom
resource, the Node, the children as applied, the key hashes already published...) and return a
:class:`Plan`: the children to create or patch, the metadata patches of objects we do not own (the
Node), the status (conditions, phase), the events to tell, and whether and when to look again. No
I/O and no clock (``now`` is a fact), so every decision is table-tested without an API server; the
reconciler (:mod:`.reconcile`) only gathers the facts, applies the plan (:mod:`.apply`) and maps its
waits onto kopf's retries. An import contract (``.importlinter``) keeps the kube layer out of here.

The :class:`Plan` type knows nothing of InferenceNodes: a planner for another resource fills the same
fields and the same applier carries them out.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Mapping, Sequence

from zerolayer.operator import conditions as cond
from zerolayer.operator import manifests as m
from zerolayer.operator import validation
from zerolayer.operator.config import OperatorConfig


# ====================================================================== the plan
@dataclasses.dataclass(frozen=True)
class Note:
    """One thing to tell as a Kubernetes Event: on the reconciled object, or with ``about`` on
    another one (sent at once, not folded into the reconcile's summary event)."""

    reason: str
    message: str
    warning: bool = False
    about: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Retry:
    """Something outside the operator is missing or still moving: look again after ``delay`` seconds."""

    message: str
    delay: float


@dataclasses.dataclass(frozen=True)
class MetadataPatch:
    """Labels and annotations to merge into an object the operator does not own (None removes a key);
    ``note`` is told when the patch is made."""

    api_version: str
    kind: str
    name: str
    namespace: str | None = None
    labels: Mapping[str, str | None] | None = None
    annotations: Mapping[str, str | None] | None = None
    note: Note | None = None


@dataclasses.dataclass(frozen=True)
class Removal:
    """A child to delete by name if it exists (it is replaced by another); ``message`` says why."""

    api_version: str
    kind: str
    name: str
    namespace: str | None
    message: str


@dataclasses.dataclass(frozen=True)
class Publication:
    """A TenantQuota's entry in the fleet's key-hash Secret: ``entry``, or None to withdraw it."""

    entry: str | None


@dataclasses.dataclass
class Plan:
    """What one reconcile of one object should do, in the order the applier does it: publish,
    patch metadata, create or patch ``children``, delete ``removals``, then (when ``phase`` is set)
    merge ``conditions`` into the status with ``phase`` and ``status`` fields and tell ``notes``;
    finally fail for a person (``invalid``) or look again (``retry``).

    A plan whose ``phase`` is None is the first half of a reconcile: its status follows from what
    the children became, so the reconciler applies it and plans again with them as facts.
    """

    children: list[dict] = dataclasses.field(default_factory=list)
    patches: list[MetadataPatch] = dataclasses.field(default_factory=list)
    removals: list[Removal] = dataclasses.field(default_factory=list)
    conditions: list[dict] = dataclasses.field(default_factory=list)
    phase: str | None = None
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[Note] = dataclasses.field(default_factory=list)
    retry: Retry | None = None
    invalid: list[str] = dataclasses.field(default_factory=list)
    ready: bool = False
    publication: Publication | None = None

    @property
    def settled(self) -> bool:
        """Whether the status is decided (False: apply the children, then plan again with them)."""
        return self.phase is not None


def transition_notes(body: Mapping[str, Any], updates: Sequence[Mapping[str, Any]], phase: str) -> list[Note]:
    """One note when Ready flips, saying why: a warning only when something broke (Degraded, Pending);
    not ready while progressing is normal."""
    old = cond.find((body.get("status") or {}).get("conditions"), "Ready")
    new = cond.find(updates, "Ready")
    if new is None or (old is not None and old.get("status") == new["status"]):
        return []
    if new["status"] == cond.TRUE:
        return [Note("Ready", new["message"])]
    return [Note(new["reason"], new["message"], warning=phase in ("Degraded", "Pending"))]


def _models_notes(body: Mapping[str, Any], updates: Sequence[Mapping[str, Any]]) -> list[Note]:
    """One warning when ModelsReady turns False or its reason changes, saying why."""
    old = cond.find((body.get("status") or {}).get("conditions"), "ModelsReady")
    new = cond.find(updates, "ModelsReady")
    if new is None or new["status"] != cond.FALSE:
        return []
    if old is not None and (old.get("status"), old.get("reason")) == (new["status"], new["reason"]):
        return []
    return [Note(new["reason"], new["message"], warning=True)]


def _status_plan(body: Mapping[str, Any], updates: list[dict], phase: str, **fields: Any) -> Plan:
    """A plan whose status is decided: ``updates`` with ``phase``, and the Ready transition told."""
    return Plan(conditions=updates, phase=phase, status=fields, notes=transition_notes(body, updates, phase))


# ====================================================================== InferenceNode
@dataclasses.dataclass(frozen=True)
class InferenceNodeFacts:
    """What the reconciler read for one InferenceNode, each fact only once the ones before it allow
    going on (an invalid spec reads nothing; a missing Node stops there...).

    ``claimant``: the InferenceNode named by the Node's claim annotation when that is another one.
    ``storage``: (reason, message) for the first model PersistentVolumeClaim or token Secret missing.
    ``runtime``: the runtime DaemonSet as applied (None before the children are applied).
    ``pods``: the runtime's pods, read only when :func:`needs_pods` says so."""

    inode: Mapping[str, Any]
    config: OperatorConfig
    now: datetime.datetime
    node: Mapping[str, Any] | None = None
    claimant: Mapping[str, Any] | None = None
    storage: tuple[str, str] | None = None
    runtime: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] | None = None


def claimant_name(inode: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """The other InferenceNode the Node's claim annotation names, if any (it must be read)."""
    claimed_by = ((node.get("metadata") or {}).get("annotations") or {}).get(m.CLAIM_ANNOTATION)
    return claimed_by if claimed_by and claimed_by != inode["metadata"]["name"] else None


def claimed_by_other(facts: InferenceNodeFacts) -> bool:
    """Whether another live InferenceNode serves the Node (one per Node: a second one would run a
    second runtime on the same GPUs)."""
    other = facts.claimant
    return other is not None and not other["metadata"].get("deletionTimestamp")


def spec_refused(inode: Mapping[str, Any]) -> bool:
    """Whether the spec alone refuses the reconcile (nothing needs reading)."""
    spec = inode.get("spec") or {}
    return bool(validation.inference_node_problems(spec) or validation.engine_args_problems(spec))


def _model_fetches(spec: Mapping[str, Any]) -> set[str]:
    return {c["name"] for c in m.build_model_storage(spec, "-", "-").init_containers}


def needs_pods(facts: InferenceNodeFacts) -> bool:
    """Whether ModelsReady needs the runtime's pods: models are downloaded and the runtime is not
    ready yet (the init containers' statuses tell the download's progress or failure)."""
    if facts.runtime is None:
        return False
    ready = runtime_condition(facts.runtime, facts.inode["spec"]["nodeName"])
    return bool(_model_fetches(facts.inode["spec"])) and ready["status"] != cond.TRUE


def runtime_condition(daemonset: Mapping[str, Any], node_name: str) -> dict:
    """RuntimeReady from the runtime DaemonSet's status."""
    status = daemonset.get("status") or {}
    meta = daemonset.get("metadata") or {}
    desired = status.get("desiredNumberScheduled", 0)
    ready = status.get("numberReady", 0)
    updated = status.get("updatedNumberScheduled", 0)
    if status.get("observedGeneration", 0) < meta.get("generation", 1):
        return cond.condition("RuntimeReady", False, "RolloutPending",
                              "the DaemonSet controller has not seen the latest runtime spec yet")
    if desired == 0:
        return cond.condition("RuntimeReady", False, "NotScheduled",
                              f"no runtime pod is scheduled on node {node_name} yet")
    if updated < desired:
        return cond.condition("RuntimeReady", False, "RollingOut",
                              f"{updated}/{desired} runtime pods run the latest spec")
    if ready < desired:
        return cond.condition("RuntimeReady", False, "PodNotReady",
                              f"{ready}/{desired} runtime pods are ready on node {node_name}")
    return cond.condition("RuntimeReady", True, "PodReady", f"runtime pod is ready on node {node_name}")


def _parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def gossip_condition(inode: Mapping[str, Any], now: datetime.datetime) -> dict:
    """GossipFresh from the runtime's last GPU-map heartbeat."""
    stale_after = int(((inode.get("spec") or {}).get("gossip") or {}).get("staleAfterSeconds", 30))
    beat = _parse_time((inode.get("status") or {}).get("lastHeartbeat"))
    if beat is None:
        return cond.condition("GossipFresh", cond.UNKNOWN, "NoHeartbeat",
                              "the runtime has not published its GPU map yet")
    if (now - beat).total_seconds() > stale_after:
        return cond.condition("GossipFresh", False, "HeartbeatStale",
                              f"last GPU-map heartbeat is older than {stale_after}s")
    return cond.condition("GossipFresh", True, "HeartbeatRecent", f"GPU-map heartbeat within the last {stale_after}s")


def models_condition(spec: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | None) -> dict:
    """ModelsReady: mounted, still downloading, or a download that failed (``pods`` given only
    when :func:`needs_pods`)."""
    fetches = _model_fetches(spec)
    if fetches and pods is not None:
        if not pods:
            return cond.condition("ModelsReady", cond.UNKNOWN, "ModelDownloadPending",
                                  "no runtime pod exists yet to download the models")
        for pod in pods:
            found = m.fetch_progress(pod, fetches)
            if found is not None:
                return cond.condition("ModelsReady", *found)
    count = len(spec.get("models") or ())
    return cond.condition("ModelsReady", True, "ModelsAvailable",
                          f"{count} model source(s) mounted" + (", downloads complete" if fetches else ""))


def _refusal(facts: InferenceNodeFacts) -> Plan | None:
    """The plan when the spec, the Node or its claim stops the reconcile before any write."""
    inode, spec = facts.inode, facts.inode.get("spec") or {}
    problems = validation.inference_node_problems(spec)
    if problems:
        return dataclasses.replace(_status_plan(inode, [cond.condition("Ready", False, "InvalidSpec",
                                                                       "; ".join(problems))], "Degraded"),
                                   invalid=problems)
    problems = validation.engine_args_problems(spec)
    if problems:
        # Before any child is written: the running runtime keeps its last good spec.
        message = "; ".join(problems)
        return Plan(conditions=[cond.condition("Ready", False, "InvalidEngineArgs", message)], phase="Degraded",
                    notes=[Note("InvalidEngineArgs", message, warning=True)], invalid=problems)
    node_name, retry = spec["nodeName"], facts.config.retry_seconds
    if facts.node is None:
        message = f"Kubernetes Node {node_name} does not exist; waiting for it to join the cluster"
        updates = [cond.condition(t, False, "NodeMissing", message) for t in ("NodeFound", "NodeLabelled", "Ready")]
        return dataclasses.replace(_status_plan(inode, updates, "Pending"), retry=Retry(message, retry))
    if facts.claimant is not None and claimed_by_other(facts):
        message = f"node {node_name} is already served by InferenceNode {facts.claimant['metadata']['name']}"
        updates = [cond.condition("NodeFound", True, "NodeExists", f"Kubernetes Node {node_name} exists"),
                   cond.condition("NodeLabelled", False, "NodeClaimed", message),
                   cond.condition("Ready", False, "NodeClaimed", message)]
        return dataclasses.replace(_status_plan(inode, updates, "Degraded"), retry=Retry(message, retry))
    return None


def _node_patch(inode: Mapping[str, Any], node: Mapping[str, Any]) -> MetadataPatch | None:
    """Label the Node (this is what places the runtime there) and claim it for this InferenceNode."""
    name, spec = inode["metadata"]["name"], inode["spec"]
    meta = node.get("metadata") or {}
    wanted = m.node_labels(m.gpu_type_of(spec, node))
    have = meta.get("labels") or {}
    missing = {k: v for k, v in wanted.items() if have.get(k) != v}
    if not missing and (meta.get("annotations") or {}).get(m.CLAIM_ANNOTATION) == name:
        return None
    note = Note("NodeLabelled", f"Labelled node {spec['nodeName']} with " +
                ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))) if missing else None
    return MetadataPatch("v1", "Node", spec["nodeName"], labels=missing,
                         annotations={m.CLAIM_ANNOTATION: name}, note=note)


def release_node(inode: Mapping[str, Any], node: Mapping[str, Any] | None) -> MetadataPatch | None:
    """On deletion: remove our labels and claim from the Node. Only the InferenceNode that claimed
    it does (a refused second one must not take the runtime away from the first)."""
    name, node_name = inode["metadata"]["name"], inode["spec"]["nodeName"]
    meta = (node or {}).get("metadata") or {}
    labels, claimed_by = meta.get("labels") or {}, (meta.get("annotations") or {}).get(m.CLAIM_ANNOTATION)
    ours = [k for k in (m.INFERENCE_NODE_LABEL, m.GPU_TYPE_LABEL) if k in labels]
    if node is None or claimed_by not in (name, None) or not (ours or claimed_by):
        return None
    note = Note("NodeUnlabelled", f"Removed labels {', '.join(ours)} from node {node_name}") if ours else None
    return MetadataPatch("v1", "Node", node_name, labels={k: None for k in ours},
                         annotations={m.CLAIM_ANNOTATION: None} if claimed_by else None, note=note)


def _node_conditions(inode: Mapping[str, Any], node: Mapping[str, Any]) -> list[dict]:
    node_name = inode["spec"]["nodeName"]
    wanted = m.node_labels(m.gpu_type_of(inode["spec"], node))
    labelled = f"node {node_name} carries " + ", ".join(f"{k}={v}" for k, v in sorted(wanted.items()))
    return [cond.condition("NodeFound", True, "NodeExists", f"Kubernetes Node {node_name} exists"),
            cond.condition("NodeLabelled", True, "Labelled", labelled)]


def inference_node_children(inode: Mapping[str, Any], config: OperatorConfig,
                            node: Mapping[str, Any] | None = None) -> list[dict]:
    """The InferenceNode's children; with its ``node``, the runtime DaemonSet too (sized by the
    Node's allocatable GPUs, its auditor by the Node's kernel)."""
    children = [m.build_serviceaccount(inode, config), m.build_clusterrole(inode, config),
                m.build_clusterrolebinding(inode, config), m.build_headless_service(inode, config),
                m.build_runtime_networkpolicy(inode, config), m.build_keys_role(inode, config),
                m.build_keys_rolebinding(inode, config)]
    if node is not None:
        status = node.get("status") or {}
        allocatable = (status.get("allocatable") or {}).get("nvidia.com/gpu")
        node_gpus = int(str(allocatable)) if str(allocatable or "").isdigit() else None
        kernel = (status.get("nodeInfo") or {}).get("kernelVersion")
        children.append(m.build_daemonset(inode, config, node_gpus, kernel))
    return children


def _runtime_status(facts: InferenceNodeFacts, node_parts: list[dict]) -> Plan:
    """The status once the runtime DaemonSet is applied: Ready when the node, the models, the runtime
    and its heartbeat all are; else why not (a failure explains more than a state not known yet)."""
    inode, node_name = facts.inode, facts.inode["spec"]["nodeName"]
    assert facts.runtime is not None
    models = models_condition(inode["spec"], facts.pods)
    gossip = gossip_condition(inode, facts.now)
    parts = node_parts + [models, runtime_condition(facts.runtime, node_name), gossip]
    not_ready = [c for c in parts if c["status"] != cond.TRUE]
    if not_ready:
        first = next((c for c in not_ready if c["status"] == cond.FALSE), not_ready[0])
        ready = cond.condition("Ready", False, first["reason"], first["message"])
        phase = "Degraded" if cond.FALSE in (gossip["status"], models["status"]) else "Progressing"
    else:
        ready = cond.condition("Ready", True, "RuntimeServing",
                               f"runtime is ready on node {node_name} and publishing its GPU map")
        phase = "Ready"
    updates = parts + [ready]
    plan = Plan(conditions=updates, phase=phase, ready=not not_ready,
                notes=_models_notes(inode, updates) + transition_notes(inode, updates, phase))
    if models["status"] != cond.TRUE:
        # Neither a download's progress nor its failure changes the DaemonSet's status (which is
        # what triggers reconciles): look at the pod again soon.
        plan.retry = Retry(models["message"], min(15.0, facts.config.retry_seconds))
    return plan


def plan_inference_node(facts: InferenceNodeFacts) -> Plan:
    """The plan for one InferenceNode.

    Refused (invalid spec or engine arguments, Node missing or served by another InferenceNode):
    the status says why and nothing else is written. Model storage missing: the children but not
    the DaemonSet (a pod whose claim or token Secret is missing would only sit in Pending; an
    existing DaemonSet keeps its previous spec, so the pod that serves now keeps serving). Otherwise
    the Node patch and every child, status unsettled; once ``facts.runtime`` is known, the status."""
    refused = _refusal(facts)
    if refused is not None:
        return refused
    inode, node = facts.inode, facts.node
    assert node is not None
    node_parts = _node_conditions(inode, node)
    if facts.runtime is not None:
        return _runtime_status(facts, node_parts)
    patch = _node_patch(inode, node)
    patches = [patch] if patch is not None else []
    if facts.storage is not None:
        updates = node_parts + [cond.condition("ModelsReady", False, *facts.storage),
                                cond.condition("Ready", False, *facts.storage)]
        return Plan(children=inference_node_children(inode, facts.config), patches=patches, conditions=updates,
                    phase="Pending", notes=_models_notes(inode, updates) + transition_notes(inode, updates, "Pending"),
                    retry=Retry(facts.storage[1], facts.config.retry_seconds))
    return Plan(children=inference_node_children(inode, facts.config, node), patches=patches)


# ====================================================================== TenantQuota
@dataclasses.dataclass(frozen=True)
class TenantQuotaFacts:
    """What the reconciler read for one TenantQuota, each fact only once the ones before allow.

    ``secret``: (reason, message) of why its API-key Secret cannot be used, else None with
    ``key_count`` and ``key_hashes`` read from it. ``published``: the fleet's published key entries
    by TenantQuota name (:func:`~.manifests.read_tenant_key_entry`). ``cilium``: whether the Cilium
    CRD is installed. ``legacy_checked``: this process already removed (or found no) Role and
    RoleBinding of the pre-hash operator for it."""

    tquota: Mapping[str, Any]
    config: OperatorConfig
    secret: tuple[str, str] | None = None
    key_count: int = 0
    key_hashes: tuple[str, ...] = ()
    published: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    cilium: bool = False
    legacy_checked: bool = False


def tenant_quota_problems(tquota: Mapping[str, Any], config: OperatorConfig) -> tuple[str, list[str]] | None:
    """(reason, problems) when the spec is invalid or names a Secret namespace it may not use."""
    problems = validation.tenant_quota_problems(tquota.get("spec") or {})
    if problems:
        return "InvalidSpec", problems
    namespace, secret, _ = m.secret_ref(tquota, config)
    refused = validation.key_secret_namespace_problem(namespace, secret, fleet_secret=m.TENANT_KEYS_SECRET,
                                                      runtime_namespace=config.runtime_namespace)
    if refused is not None:
        return refused[0], [refused[1]]
    if not m.secret_namespace_allowed(tquota, config):
        return "SecretNamespaceNotAllowed", [
            f"apiKeySecretRef.namespace {namespace!r} is not one of the tenant's namespaces, the "
            "runtime namespace or the operator's tenant Secret namespaces"]
    return None


def secret_problem(found: bool, has_key: bool, key_count: int, namespace: str, secret: str,
                   key: str) -> tuple[str, str] | None:
    """(reason, message) of why an API-key Secret's keys cannot be used, else None. Messages name
    the Secret and the entry, never anything read from it."""
    if not found:
        return ("SecretMissing", f"API-key Secret {namespace}/{secret} does not exist")
    if not has_key:
        return ("KeyMissing", f"API-key Secret {namespace}/{secret} has no entry {key!r}")
    if key_count == 0:
        return ("NoKeys", f"entry {key!r} of API-key Secret {namespace}/{secret} holds no keys")
    return None


def _legacy_removals(tquota: Mapping[str, Any], config: OperatorConfig) -> list[Removal]:
    """Before runtimes got hashes, each TenantQuota had a Role and RoleBinding ``zl-tenant-<name>``
    letting the runtime namespace read its Secret. A TenantQuota with no status was never
    reconciled, so no older operator made them."""
    if not (tquota.get("status") or {}).get("conditions"):
        return []
    namespace, child = m.secret_ref(tquota, config)[0], m.tenant_name(tquota["metadata"]["name"])
    return [Removal("rbac.authorization.k8s.io/v1", kind, child, namespace, f"Deleted {kind} {namespace}/{child} "
                    "(runtimes no longer read tenants' Secrets)") for kind in ("RoleBinding", "Role")]


def duplicate_of(tquota: Mapping[str, Any], hashes: Sequence[str],
                 published: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, str] | None:
    """(reason, other TenantQuota, message) when an older TenantQuota already holds this tenant
    name or one of these keys; the older one (creationTimestamp, then name) keeps them, so every
    operator and runtime picks the same winner."""
    name = tquota["metadata"]["name"]
    tenant = tquota["spec"]["tenant"]
    mine = (tquota["metadata"].get("creationTimestamp") or "", name)
    for other, entry in sorted(published.items()):
        if other == name or (entry["created"], other) > mine:
            continue
        if entry["tenant"] == tenant:
            return ("DuplicateTenant", other, f"tenant {tenant!r} is already declared by the older TenantQuota {other}")
        if set(entry["hashes"]) & set(hashes):
            return ("DuplicateKey", other, f"an API key of this tenant is also a key of the older TenantQuota {other} "
                                           f"(tenant {entry['tenant']!r}); keys must be unique")
    return None


def _admitted(facts: TenantQuotaFacts) -> Plan:
    tquota, config = facts.tquota, facts.config
    spec, name = tquota["spec"], tquota["metadata"]["name"]
    namespace, secret, _ = m.secret_ref(tquota, config)
    policy = m.build_ciliumnetworkpolicy(tquota, config) if facts.cilium else \
        m.build_tenant_networkpolicy(tquota, config)
    removals = [] if facts.legacy_checked else _legacy_removals(tquota, config)
    if facts.cilium:
        # The L7 policy replaces the plain one (see build_ciliumnetworkpolicy).
        child, ns = m.tenant_name(name), config.runtime_namespace
        removals.append(Removal("networking.k8s.io/v1", "NetworkPolicy", child, ns, f"Deleted NetworkPolicy {ns}/"
                                f"{child} (replaced by a CiliumNetworkPolicy with L7 rules)"))
    kind = "CiliumNetworkPolicy" if facts.cilium else "NetworkPolicy"
    namespaces = ", ".join(sorted(set(spec["namespaces"])))
    updates = [
        cond.condition("SecretFound", True, "SecretFound",
                       f"API-key Secret {namespace}/{secret} holds {facts.key_count} key(s)"),
        cond.condition("PoliciesApplied", True, "PoliciesApplied", f"{kind} {policy['metadata']['name']} admits "
                       f"namespaces {namespaces} to the runtimes' serving port"),
        cond.condition("Ready", True, "TenantAdmitted", f"tenant {spec['tenant']} can reach the runtimes from "
                       f"{namespaces}"),
    ]
    plan = _status_plan(tquota, updates, "Ready", keyCount=facts.key_count,
                        networkPolicies=[policy["metadata"]["name"]])
    return dataclasses.replace(plan, children=[policy], removals=removals, ready=True, publication=Publication(
        m.build_tenant_key_entry(tquota, list(facts.key_hashes))))


def plan_tenant_quota(facts: TenantQuotaFacts) -> Plan:
    """The plan for one TenantQuota: its key hashes published and its NetworkPolicy (or, with
    Cilium, CiliumNetworkPolicy) applied; or, when its spec is invalid, its Secret unusable or its
    tenant or keys already another's, withdrawn (the runtimes drop it at their next sync) and why."""
    tquota, config, withdraw = facts.tquota, facts.config, Publication(None)
    refused = tenant_quota_problems(tquota, config)
    if refused is not None:
        reason, problems = refused
        plan = _status_plan(tquota, [cond.condition("Ready", False, reason, "; ".join(problems))], "Degraded",
                            keyCount=0)
        return dataclasses.replace(plan, invalid=problems, publication=withdraw)
    if facts.secret is not None:
        # Not served until its keys can be read.
        plan = _status_plan(tquota, [cond.condition("SecretFound", False, *facts.secret),
                                     cond.condition("Ready", False, *facts.secret)], "Pending", keyCount=0)
        return dataclasses.replace(plan, publication=withdraw,
                                   retry=Retry(facts.secret[1], min(10.0, config.retry_seconds)))
    clash = duplicate_of(tquota, facts.key_hashes, facts.published)
    if clash is not None:
        reason, other, message = clash
        namespace, secret, _ = m.secret_ref(tquota, config)
        found = cond.condition("SecretFound", True, "SecretFound",
                               f"API-key Secret {namespace}/{secret} holds {facts.key_count} key(s)")
        plan = _status_plan(tquota, [found, cond.condition("Ready", False, reason, message)], "Degraded",
                            keyCount=facts.key_count)
        older = {"apiVersion": m.API_VERSION, "kind": "TenantQuota", "metadata": {"name": other}}
        plan.notes.append(Note(reason, f"TenantQuota {tquota['metadata']['name']} was refused: {message}",
                               warning=True, about=older))
        return dataclasses.replace(plan, publication=withdraw, retry=Retry(message, config.retry_seconds))
    return _admitted(facts)
