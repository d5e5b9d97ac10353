"""Thin kopf handlers: translate kopf's callbacks into :class:`~.reconcile.Reconciler` calls
and our errors into kopf's retry semantics. No logic lives here.

Reconciles are driven by watches, never by per-object timers:
- an InferenceNode or TenantQuota: create, spec update, operator start (resume);
- a child (DaemonSet, Service, ServiceAccount, NetworkPolicy, Role, RoleBinding, ClusterRole,
  ClusterRoleBinding): its deletion, an edit that makes it differ from what the operator last
  applied (``Kube.drifted``), a change of the DaemonSet's readiness;
- a Node: disappearing or losing its label (seen as its runtime DaemonSet becoming unscheduled:
  no watch follows every Node, see nodes.py), appearing when an InferenceNode waits
  for it (a watch of that one Node by name); an InferenceNode's first fresh heartbeat.
A converged, idle fleet therefore costs nothing but the watches themselves and the leader's
Lease renewals. One full resync (``Reconciler.resync_forever``: every ``resync_seconds``,
hours, jittered) re-reads everything from the API server to bound drift no watch could see.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Awaitable, Mapping

import kopf

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import KubeError, SpecError, WaitingFor
from zerolayer.operator.fleet import SYNC_SECONDS as FLEET_SYNC_SECONDS
from zerolayer.operator.fleet import FleetReconciler
from zerolayer.operator.kopfstate import KopfState
from zerolayer.operator.kube import Credentials, Kube
from zerolayer.operator.metrics import OperatorMetrics
from zerolayer.operator.model_endpoints import ModelEndpoints
from zerolayer.operator.model_plan import MODEL_SERVICE_LABEL
from zerolayer.operator.reconcile import TQUOTA as TQUOTA_KIND
from zerolayer.operator.reconcile import Reconciler

_INODE = {"group": m.GROUP, "version": m.VERSION, "plural": "inferencenodes"}
_TQUOTA = {"group": m.GROUP, "version": m.VERSION, "plural": "tenantquotas"}
_FLEET = {"group": m.GROUP, "version": m.VERSION, "plural": "inferencefleets"}
OURS = {"app.kubernetes.io/managed-by": "zerolayer-operator"}
FINALIZER = "zerolayer.io/finalizer"
# How soon a TenantQuota reconcile notices that Cilium was installed (the operator may only get
# CRDs, not watch them). Idle, nothing reconciles, so this costs nothing then.
CRD_CACHE_SECONDS = 30.0
# Kinds whose every event reaches Kube.observe below (namespaced ones in the runtime namespace).
WATCHED_KINDS = ((m.API_VERSION, "InferenceNode", False), (m.API_VERSION, "TenantQuota", False),
                 (m.API_VERSION, "InferenceFleet", False),
                 ("v1", "Service", True), ("v1", "ServiceAccount", True),
                 ("apps/v1", "DaemonSet", True), ("networking.k8s.io/v1", "NetworkPolicy", True),
                 ("rbac.authorization.k8s.io/v1", "Role", True), ("rbac.authorization.k8s.io/v1", "RoleBinding", True),
                 ("rbac.authorization.k8s.io/v1", "ClusterRole", False),
                 ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", False))


def finalizer_for(selector: Mapping[str, str] | None) -> str:
    """The finalizer this operator puts on its objects: :data:`FINALIZER`, or with ``--selector``
    ``FINALIZER-<8 hex digits of the selector>``. kopf strips its finalizer from every object its
    filters exclude, so operators sharding one cluster by selector must not share the name, or each
    would remove the other's (and its objects would be deleted without their cleanup)."""
    if not selector:
        return FINALIZER
    key = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    return f"{FINALIZER}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def plain(value: Any) -> Any:
    """kopf's read-only views as plain dicts and lists (the reconciler takes plain data)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


async def run(step: Awaitable[Any]) -> Any:
    """Await a reconciler step, mapping our errors onto kopf's retry semantics."""
    try:
        return await step
    except SpecError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except WaitingFor as exc:
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from exc
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=2 if exc.retryable else 30) from exc


def _owner(body: Mapping[str, Any]) -> tuple[str, str] | None:
    value = (body.get("metadata", {}).get("annotations") or {}).get(m.OWNER_NAME_ANNOTATION, "")
    kind, _, name = value.partition("/")
    return (kind, name) if kind and name else None


def build_registry(config: OperatorConfig, *, kubeconfig: str | None = None,
                   metrics: OperatorMetrics | None = None,
                   selector: Mapping[str, str] | None = None, identity: str | None = None) -> kopf.OperatorRegistry:
    """All handlers, registered into a fresh registry (so tests can build several).

    ``selector`` (labels) limits the operator to the InferenceNodes and TenantQuotas that
    carry them, so several operators (or test runs) can share one cluster.
    """
    registry = kopf.OperatorRegistry()
    metrics = metrics or OperatorMetrics()
    state = KopfState()
    labels = {"labels": dict(selector)} if selector else {}
    _register_lifecycle(registry, config, kubeconfig, metrics, selector, identity, state)
    _register_inference_nodes(registry, {**_INODE, **labels}, state)
    _register_tenant_quotas(registry, {**_TQUOTA, **labels}, state)
    _register_fleets(registry, {**_FLEET, **labels})
    _register_children(registry)
    return registry


def _register_lifecycle(registry: kopf.OperatorRegistry, config: OperatorConfig, kubeconfig: str | None,
                        metrics: OperatorMetrics, selector: Mapping[str, str] | None, identity: str | None,
                        state: KopfState) -> None:
    """Start-up (settings, the client, the reconcilers, the full resync), login, clean-up and the probe."""
    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = finalizer_for(selector)
        # kopf's bookkeeping stays in memory: no PATCH per object after each handling (kopfstate.py).
        settings.persistence.progress_storage = state.progress
        settings.persistence.diffbase_storage = state.diffbase
        # Our events tell the story; kopf's own "Handler succeeded" events would drown it.
        settings.posting.level = logging.WARNING
        # Each watch is re-opened when the server ends it; at 30 min the dozen watches cost about
        # one request every 150 s while idle (the API server's own cap is 30-60 min by default).
        settings.watching.server_timeout = 1800
        # The runtime namespace is one exact name and the CRDs are installed before the operator
        # (by the chart): no need to list namespaces or watch CRDs for new resources, so the
        # operator's RBAC needs neither.
        settings.scanning.disabled = True
        # Only the login handler is synchronous; it needs no more threads than this.
        settings.execution.max_workers = 4
        credentials = await asyncio.to_thread(Credentials.load, kubeconfig)  # reads files
        kube = Kube(credentials, on_request=metrics.on_request, identity=identity,
                    crd_cache_seconds=min(config.resync_seconds, CRD_CACHE_SECONDS))
        ns = config.runtime_namespace
        for api_version, kind, namespace in WATCHED_KINDS:
            kube.watch(api_version, kind, ns if namespace else None)
        kube.remember("v1", "Node")  # no watch follows Nodes (nodes.py)
        memo.reconciler = Reconciler(kube, config, observe=metrics.observe, selector=selector)
        memo.fleets = FleetReconciler(kube, observe=metrics.observe)
        memo.endpoints = ModelEndpoints(kube, config, selector)
        memo.ready_seen = {}
        memo.resync = asyncio.create_task(memo.reconciler.resync_forever(), name="full resync")

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # A private registry has no default login handlers. kopf's watches use exactly the
        # credentials our client uses (--kubeconfig, $KUBECONFIG, ~/.kube/config, in-cluster).
        return kopf.ConnectionInfo(**Credentials.load(kubeconfig).connection_fields())

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        memo.resync.cancel()
        await asyncio.gather(memo.resync, return_exceptions=True)
        await memo.endpoints.close()
        await memo.reconciler.close()
        await memo.reconciler.kube.close()

    @kopf.on.probe(id="reconciles", registry=registry)
    async def reconciles(**_: Any) -> dict:
        # Shown in the /healthz answer: reconciliations so far by kind and result.
        return {f"{s.labels['kind']}/{s.labels['result']}": s.value
                for family in metrics.reconciles.collect() for s in family.samples if s.name.endswith("_total")}


def _register_inference_nodes(registry: kopf.OperatorRegistry, inodes: dict, state: KopfState) -> None:
    @kopf.on.resume(**inodes, registry=registry)
    @kopf.on.create(**inodes, registry=registry)
    @kopf.on.update(**inodes, field="spec", registry=registry)
    async def inference_node_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.endpoints.soon()  # its models' Services (model_endpoints.py)
        await run(memo.reconciler.reconcile_inference_node(plain(body)))

    @kopf.on.delete(**inodes, registry=registry)
    async def inference_node_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.endpoints.soon()
        await run(memo.reconciler.delete_inference_node(plain(body)))

    @kopf.on.event(**inodes, registry=registry)
    async def inference_node_heartbeat(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo,
                                       **_: Any) -> None:
        memo.reconciler.kube.observe(event.get("type"), plain(body))  # by-name reconciles read the cache
        state.forget_if_deleted(event)
        if event.get("type") in ("ADDED", "DELETED"):
            memo.endpoints.soon()  # now that the cache has it
        # Only the first fresh heartbeat (GossipFresh not yet True) needs a prompt reconcile;
        # later heartbeats change nothing the operator writes.
        status = body.get("status") or {}
        fresh = any(c.get("type") == "GossipFresh" and c.get("status") == "True"
                    for c in status.get("conditions") or ())
        if event.get("type") == "MODIFIED" and status.get("lastHeartbeat") and not fresh \
                and (body.get("metadata") or {}).get("finalizers") and not body["metadata"].get("deletionTimestamp"):
            await run(memo.reconciler.reconcile_inference_node(plain(body)))


def _register_tenant_quotas(registry: kopf.OperatorRegistry, tquotas: dict, state: KopfState) -> None:
    @kopf.on.resume(**tquotas, registry=registry)
    @kopf.on.create(**tquotas, registry=registry)
    @kopf.on.update(**tquotas, field="spec", registry=registry)
    async def tenant_quota_changed(body: kopf.Body, old: Any, memo: kopf.Memo, **_: Any) -> None:
        previous = {"spec": plain(old)} if old else None  # with field="spec", old/new are the specs
        await run(memo.reconciler.reconcile_tenant_quota(plain(body), previous))

    @kopf.on.event(**tquotas, registry=registry)
    async def tenant_quota_seen(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.kube.observe(event.get("type"), plain(body))  # by-name reconciles read the cache
        state.forget_if_deleted(event)

    @kopf.on.delete(**tquotas, registry=registry)
    async def tenant_quota_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await run(memo.reconciler.delete_tenant_quota(plain(body)))

    @kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", registry=registry,
                   when=lambda name, **_: name == m.CILIUM_CRD)
    async def cilium_changed(event: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
        # Cilium installed or removed: every TenantQuota's policy changes kind (L7 or plain).
        if memo.reconciler.kube.note_crd(m.CILIUM_CRD, event.get("type") != "DELETED"):
            await memo.reconciler.reconcile_every(TQUOTA_KIND)


def _register_fleets(registry: kopf.OperatorRegistry, fleets: dict) -> None:
    @kopf.on.resume(**fleets, registry=registry)
    @kopf.on.create(**fleets, registry=registry)
    @kopf.on.update(**fleets, field="spec", registry=registry)
    @kopf.timer(**fleets, interval=FLEET_SYNC_SECONDS, registry=registry)
    async def inference_fleet_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await run(memo.fleets.reconcile(plain(body)))

    @kopf.on.event(**fleets, registry=registry)
    async def inference_fleet_seen(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.kube.observe(event.get("type"), plain(body))


async def reconcile_owner(owner: tuple[str, str] | None, memo: kopf.Memo) -> None:
    if owner is None:
        return
    kind, name = owner
    if kind == "InferenceNode":
        await run(memo.reconciler.reconcile_inference_node_by_name(name))
    elif kind == "TenantQuota":
        await run(memo.reconciler.reconcile_tenant_quota_by_name(name))


def _register_children(registry: kopf.OperatorRegistry) -> None:
    """Children (by the OURS label) and the runtime DaemonSets: repair on deletion or drift, and a
    coalesced reconcile of the owner when a DaemonSet's readiness moves."""
    def child_changed(group: str, version: str, plural: str) -> None:
        @kopf.on.event(group, version, plural, labels=OURS, id=f"{plural}-changed", registry=registry)
        async def _changed(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
            obj = plain(body)
            memo.reconciler.kube.observe(event.get("type"), obj)
            # Deleted (or no longer labelled ours, which a label-filtered watch reports as a
            # deletion), or edited away from what we applied: repair it now.
            if event.get("type") == "DELETED" or memo.reconciler.kube.drifted(obj):
                if MODEL_SERVICE_LABEL in (obj["metadata"].get("labels") or {}):
                    memo.endpoints.soon()  # a model's Service: owned by no one InferenceNode
                    return
                await reconcile_owner(_owner(body), memo)

    for group, version, plural in (("", "v1", "services"), ("", "v1", "serviceaccounts"),
                                   ("networking.k8s.io", "v1", "networkpolicies"),
                                   ("rbac.authorization.k8s.io", "v1", "clusterroles"),
                                   ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"),
                                   ("rbac.authorization.k8s.io", "v1", "roles"),
                                   ("rbac.authorization.k8s.io", "v1", "rolebindings")):
        child_changed(group, version, plural)

    @kopf.on.event("apps", "v1", "daemonsets", labels=OURS, registry=registry)
    async def runtime_changed(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        obj = plain(body)
        memo.reconciler.kube.observe(event.get("type"), obj)
        if memo.reconciler.kube.drifted(obj):
            await reconcile_owner(_owner(body), memo)
            return
        status = body.get("status") or {}
        seen = (status.get("desiredNumberScheduled"), status.get("numberReady"),
                status.get("updatedNumberScheduled"), status.get("observedGeneration"))
        key = body["metadata"]["name"]
        if event.get("type") == "DELETED":
            memo.ready_seen.pop(key, None)
            await reconcile_owner(_owner(body), memo)
            return
        if memo.ready_seen.get(key) == seen:
            return
        memo.ready_seen[key] = seen
        owner = _owner(body)
        if owner and owner[0] == "InferenceNode":
            # The DaemonSet controller and kwok/kubelet move its status several times while the
            # runtime comes up: one reconcile of the owner per burst, from the newest cached status.
            memo.reconciler.daemonset_changed(owner[1], obj)
