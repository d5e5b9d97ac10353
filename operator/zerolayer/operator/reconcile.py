"""Level-triggered reconciliation of InferenceNode and TenantQuota: gather, plan, apply.

Each ``reconcile_*`` takes the object's lock, gathers the facts through
:class:`~zerolayer.operator.kube.Kube` (each read only when the facts before it allow going on),
asks the pure planner (:mod:`.plan`) what should be true, and has :class:`~.apply.Applier` make it
so: running it again on a converged cluster writes nothing (and, with the watch-fed cache warm,
reads nothing either). Key publishing lives in :mod:`.keys`, waiting for Nodes in :mod:`.nodes`,
coalesced background reconciles in :mod:`.soon`.

Errors (the handlers map them to kopf's retry semantics):

- :class:`SpecError` — invalid spec; a person must fix it (kopf ``PermanentError``).
- :class:`WaitingFor` — something outside the operator is missing (the Node, the Secret);
  the status says so and a retry comes after ``delay`` (kopf ``TemporaryError``).
- :class:`~zerolayer.operator.errors.KubeError` — the API failed; kopf retries.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import logging
import random
from typing import Any, Awaitable, Callable, Mapping

from zerolayer.operator import manifests as m
from zerolayer.operator import plan as planner
from zerolayer.operator import validation
from zerolayer.operator.apply import Applier, Outcome
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import KubeError, NotFound, OperatorError, SpecError, WaitingFor
from zerolayer.operator.keys import KeyPublisher
from zerolayer.operator.kube import Kube
from zerolayer.operator.nodes import NodeWaits
from zerolayer.operator.soon import ReconcileSoon

__all__ = ["INODE", "TQUOTA", "Outcome", "Reconciler", "WaitingFor", "utcnow"]

log = logging.getLogger(__name__)

INODE = (m.API_VERSION, "InferenceNode")
TQUOTA = (m.API_VERSION, "TenantQuota")
COALESCE_SECONDS = 1.0  # a DaemonSet's status changes within this share one reconcile of its owner
ROLLOUT_SETTLE_SECONDS = 30.0  # ... while its runtime is still coming up (see Reconciler.daemonset_changed)
ROLLING_OUT = frozenset({"RolloutPending", "RollingOut", "PodNotReady"})  # RuntimeReady reasons of that
# An InferenceNode's children, in the order its finalizer deletes them (the runtime first).
RUNTIME_CHILDREN = (("apps/v1", "DaemonSet", True), ("v1", "Service", True),
                    ("networking.k8s.io/v1", "NetworkPolicy", True),
                    ("rbac.authorization.k8s.io/v1", "RoleBinding", True),
                    ("rbac.authorization.k8s.io/v1", "Role", True),
                    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", False),
                    ("rbac.authorization.k8s.io/v1", "ClusterRole", False), ("v1", "ServiceAccount", True))


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Reconciler:
    """Holds the operator's collaborators; one instance per operator process.

    ``nodes`` routes a Node event to the InferenceNodes that claim it without a list call and
    watches the Nodes they wait for; ``selector``: the labels an object must carry to be ours
    (see ``zerolayer operator --selector``).
    """

    def __init__(self, kube: Kube, config: OperatorConfig, *, now: Callable[[], datetime.datetime] = utcnow,
                 observe: Callable[[str, str], None] | None = None, selector: Mapping[str, str] | None = None):
        self.kube = kube
        self.selector = dict(selector or {})
        self.config = config
        self.now = now
        self.observe = observe or (lambda kind, result: None)
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.keys = KeyPublisher(kube, config.runtime_namespace, now)
        self.applier = Applier(kube, self.keys, now, config.retry_seconds)
        self.nodes = NodeWaits(kube, config.runtime_namespace, lambda name: self.reconcile_soon(INODE, name, delay=0.0))
        self.soon = ReconcileSoon(self._reconcile_by_name, config.retry_seconds)
        self._legacy_checked: set[str] = set()  # TenantQuotas whose pre-hash Role/RoleBinding are gone

    def _lock(self, kind: str, name: str) -> asyncio.Lock:
        # kopf runs change handlers, timers and our cross-object triggers concurrently;
        # one lock per object keeps two reconciles of it from interleaving.
        return self._locks[f"{kind}/{name}"]

    async def _reconcile(self, kind: str, body: Mapping[str, Any],
                         converge: Callable[[Mapping[str, Any], Outcome], Awaitable[None]]) -> Outcome:
        """Run ``converge`` under the object's lock on its freshest copy; count the result and tell
        what was done (also when it fails)."""
        outcome = Outcome()
        async with self._lock(kind, body["metadata"]["name"]):
            body = self.kube.freshest(body)  # a reconcile that held the lock may have moved it on
            try:
                await converge(body, outcome)
            except WaitingFor:
                self.observe(kind, "waiting")
                raise
            except SpecError:
                self.observe(kind, "invalid")
                raise
            except OperatorError:
                self.observe(kind, "error")
                raise
            finally:
                await self.applier.report(body, outcome)
            self.observe(kind, "ready" if outcome.ready else "progressing")
            return outcome

    # ================================================================= InferenceNode
    async def reconcile_inference_node(self, body: Mapping[str, Any]) -> Outcome:
        return await self._reconcile("InferenceNode", body, self._converge_inference_node)

    async def _converge_inference_node(self, body: Mapping[str, Any], outcome: Outcome) -> None:
        facts = await self._inference_node_facts(body)
        plan = planner.plan_inference_node(facts)
        objects = await self.applier.apply(body, plan, outcome)
        if plan.settled:
            return
        # The status follows from the runtime DaemonSet as applied (and its pods while models download).
        facts = dataclasses.replace(facts, runtime=objects["DaemonSet"], now=self.now())
        if planner.needs_pods(facts):
            selector = ",".join(f"{k}={v}" for k, v in sorted(m.runtime_selector(body["metadata"]["name"]).items()))
            pods = await self.kube.list("v1", "Pod", self.config.runtime_namespace, label_selector=selector)
            facts = dataclasses.replace(facts, pods=pods)
        await self.applier.apply(body, planner.plan_inference_node(facts), outcome)

    async def _inference_node_facts(self, body: Mapping[str, Any]) -> planner.InferenceNodeFacts:
        """The Node, the InferenceNode claiming it and the models' storage, each read only when the
        facts before it do not already decide the reconcile."""
        facts = planner.InferenceNodeFacts(inode=body, config=self.config, now=self.now())
        if planner.spec_refused(body):
            return facts
        name, node_name = body["metadata"]["name"], body["spec"]["nodeName"]
        self.nodes.claim(name, node_name)
        node = await self.kube.get("v1", "Node", node_name, cached=self.nodes.copy_will_do(name))
        if node is None:
            self.nodes.wait_for(node_name)
            return facts
        self.nodes.found(node_name)
        facts = dataclasses.replace(facts, node=node)
        claimant = planner.claimant_name(body, node)
        if claimant is not None:
            facts = dataclasses.replace(facts, claimant=await self.kube.get(*INODE, claimant))
            if planner.claimed_by_other(facts):
                return facts
        return dataclasses.replace(facts, storage=await self._missing_model_storage(body["spec"]))

    async def _missing_model_storage(self, spec: Mapping[str, Any]) -> tuple[str, str] | None:
        """(reason, message) for the first PersistentVolumeClaim or token Secret the models
        name that does not exist in the runtime namespace, else None."""
        ns = self.config.runtime_namespace
        for claim in m.model_claims(spec):
            if await self.kube.get("v1", "PersistentVolumeClaim", claim, ns) is None:
                return ("PVCNotFound", f"PersistentVolumeClaim {ns}/{claim} named by a model source does not "
                                       "exist; the runtime pod is held back until it does")
        for secret, key in m.model_token_secrets(spec):
            check = await self.kube.check_secret(ns, secret, key)
            if not check.found:
                return ("TokenSecretNotFound", f"Secret {ns}/{secret} named by a huggingFace tokenSecretRef does "
                                               "not exist; the runtime pod is held back until it does")
            if not check.has_key:
                return ("TokenSecretKeyMissing", f"Secret {ns}/{secret} has no entry {key!r} (huggingFace "
                                                 "tokenSecretRef); the runtime pod is held back until it does")
        return None

    async def delete_inference_node(self, body: Mapping[str, Any]) -> Outcome:
        """Finalizer work: remove the node labels and every child (owner references would
        collect the children too; deleting them here makes removal prompt and visible)."""
        outcome = Outcome()
        name = body["metadata"]["name"]
        try:
            async with self._lock("InferenceNode", name):
                await self._delete_inference_node(body, name, outcome)
        finally:
            await self.applier.report(body, outcome)
        self._locks.pop(f"InferenceNode/{name}", None)
        return outcome

    async def _delete_inference_node(self, body: Mapping[str, Any], name: str, outcome: Outcome) -> None:
        if (body.get("status") or {}).get("phase") != "Terminating":
            try:
                await self.kube.patch_status(*INODE, name, {"phase": "Terminating"})
            except NotFound:
                pass  # already gone: nothing left to show
        node_name = (body.get("spec") or {}).get("nodeName")
        if node_name:
            self.nodes.release(name, node_name)
            release = planner.release_node(body, await self.kube.get("v1", "Node", node_name))
            if release is not None:
                await self.applier.apply(body, planner.Plan(patches=[release]), outcome)
        child, ns = m.runtime_name(name), self.config.runtime_namespace
        for api_version, kind, namespaced in RUNTIME_CHILDREN:
            namespace = ns if namespaced else None
            if await self.applier.delete_owned(body, api_version, kind, child, namespace):
                where = f"{namespace}/" if namespace else ""
                self.applier.note(body, outcome, "Deleted", f"Deleted {kind} {where}{child}")

    # ================================================================= TenantQuota
    async def reconcile_tenant_quota(self, body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Outcome:
        return await self._reconcile("TenantQuota", body, self._converge_tenant_quota)

    async def _converge_tenant_quota(self, body: Mapping[str, Any], outcome: Outcome) -> None:
        await self.applier.apply(body, planner.plan_tenant_quota(await self._tenant_quota_facts(body)), outcome)
        self._legacy_checked.add(body["metadata"]["name"])

    async def _tenant_quota_facts(self, body: Mapping[str, Any]) -> planner.TenantQuotaFacts:
        """Its API-key Secret, the keys already published and whether Cilium is installed, each read
        only when the facts before it allow. A 403 counts like a 404 (RBAC is checked before
        existence): the tenant waits with a condition instead of failing the reconcile."""
        facts = planner.TenantQuotaFacts(tquota=body, config=self.config,
                                         legacy_checked=body["metadata"]["name"] in self._legacy_checked)
        if planner.tenant_quota_problems(body, self.config):
            return facts
        namespace, secret, key = m.secret_ref(body, self.config)
        try:
            check = await self.kube.check_secret(namespace, secret, key)
        except KubeError as exc:
            if exc.status != 403:
                raise
            return dataclasses.replace(facts, secret=(
                "SecretUnreadable", f"the operator may not read API-key Secret {namespace}/{secret} (403)"))
        refused = validation.key_secret_opt_in_problem(namespace, secret, dict(check.labels),
                                                       tenant=body["spec"]["tenant"],
                                                       runtime_namespace=self.config.runtime_namespace)
        if check.found and refused is not None:
            # Before anything else about it: the quota's author learns only that it exists.
            return dataclasses.replace(facts, secret=("SecretNotOptedIn", refused))
        problem = planner.secret_problem(check.found, check.has_key, check.key_count, namespace, secret, key)
        if problem is not None:
            return dataclasses.replace(facts, secret=problem)
        return dataclasses.replace(facts, key_count=check.key_count, key_hashes=tuple(check.key_hashes),
                                   published=await self.keys.published(),
                                   cilium=await self.kube.crd_exists(m.CILIUM_CRD))

    async def delete_tenant_quota(self, body: Mapping[str, Any]) -> Outcome:
        outcome = Outcome()
        name = body["metadata"]["name"]
        try:
            async with self._lock("TenantQuota", name):
                await self._delete_tenant_quota(body, name, outcome)
        finally:
            await self.applier.report(body, outcome)
        self._locks.pop(f"TenantQuota/{name}", None)
        self._legacy_checked.discard(name)
        return outcome

    async def _delete_tenant_quota(self, body: Mapping[str, Any], name: str, outcome: Outcome) -> None:
        await self.keys.publish(name, None)
        child, secret_ns = m.tenant_name(name), m.secret_ref(body, self.config)[0]
        targets = [("networking.k8s.io/v1", "NetworkPolicy", self.config.runtime_namespace),
                   ("rbac.authorization.k8s.io/v1", "RoleBinding", secret_ns),
                   ("rbac.authorization.k8s.io/v1", "Role", secret_ns)]
        if await self.kube.crd_exists(m.CILIUM_CRD):
            targets.insert(0, ("cilium.io/v2", "CiliumNetworkPolicy", self.config.runtime_namespace))
        for api_version, kind, namespace in targets:
            if await self.applier.delete_owned(body, api_version, kind, child, namespace):
                self.applier.note(body, outcome, "Deleted", f"Deleted {kind} {namespace}/{child}")

    # ================================================================= cross-object triggers
    def _selected(self, body: Mapping[str, Any] | None) -> bool:
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        labels = body["metadata"].get("labels") or {}
        return all(labels.get(k) == v for k, v in self.selector.items())

    async def reconcile_inference_node_by_name(self, name: str) -> Outcome | None:
        """Reconcile an InferenceNode named by a child's or a Node's event (None if it is gone
        or not ours)."""
        body = await self.kube.get(*INODE, name, cached=True)
        if body is None or not self._selected(body):
            return None
        return await self.reconcile_inference_node(body)

    async def reconcile_tenant_quota_by_name(self, name: str) -> Outcome | None:
        body = await self.kube.get(*TQUOTA, name, cached=True)
        if body is None or not self._selected(body):
            return None
        return await self.reconcile_tenant_quota(body)

    async def _reconcile_by_name(self, kind: tuple[str, str], name: str) -> Outcome | None:
        if kind == INODE:
            return await self.reconcile_inference_node_by_name(name)
        return await self.reconcile_tenant_quota_by_name(name)

    def reconcile_soon(self, kind: tuple[str, str], name: str, delay: float = COALESCE_SECONDS) -> None:
        """Reconcile the named object ``delay`` seconds from now, in the background; requests for it
        until then join that one (see :class:`~.soon.ReconcileSoon`)."""
        self.soon(kind, name, delay)

    def daemonset_changed(self, owner: str, daemonset: Mapping[str, Any]) -> None:
        """A runtime DaemonSet's status moved: reconcile its InferenceNode once per burst.

        While the runtime is still coming up (the rollout not yet seen, pods not yet updated or
        not yet ready) the owner is reconciled only ``ROLLOUT_SETTLE_SECONDS`` later, unless the
        runtime becomes ready (or is not scheduled at all) first: each intermediate state would
        otherwise be one more status write per InferenceNode (measured: about two per node
        at 200 nodes), and none of them changes Ready."""
        reason = planner.runtime_condition(daemonset, "")["reason"]
        self.reconcile_soon(INODE, owner, ROLLOUT_SETTLE_SECONDS if reason in ROLLING_OUT else COALESCE_SECONDS)

    async def close(self) -> None:
        """Cancel the background reconciles still waiting to run and the watches for missing Nodes."""
        await self.soon.close(self.nodes.close())

    # ================================================================= the full resync
    async def resync_all(self) -> dict[str, int]:
        """Re-read every selected InferenceNode and TenantQuota from the API server (the cache is
        dropped first, so children and Nodes are re-read too) and reconcile each, one at a time:
        repairs drift that no watch saw. Returns counts by result; one object's failure is
        logged and does not stop the rest (kopf retries it on its own events)."""
        self.kube.forget()
        self.keys.forget()
        counts: collections.Counter = collections.Counter()
        for kind in (INODE, TQUOTA):
            counts.update(await self.reconcile_every(kind))
        log.info("full resync done: %s", dict(counts))
        return dict(counts)

    async def reconcile_every(self, kind: tuple[str, str]) -> dict[str, int]:
        """Reconcile every selected object of one kind (listed from the API server), one at a
        time; one object's failure is logged and does not stop the rest (kopf retries it on its
        own events). Returns counts by result."""
        reconcile = self.reconcile_inference_node if kind == INODE else self.reconcile_tenant_quota
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.selector.items())) or None
        counts: collections.Counter = collections.Counter()
        for body in await self.kube.list(*kind, label_selector=selector):
            if not self._selected(body) or not (body["metadata"].get("finalizers") or ()):
                continue  # being deleted, or not yet taken on by kopf (its create handler runs)
            try:
                outcome = await reconcile(body)
                counts["ready" if outcome.ready else "progressing"] += 1
            except OperatorError as exc:
                counts["not converged"] += 1
                log.info("%s %s: %s", kind[1], body["metadata"]["name"], exc)
        return dict(counts)

    async def resync_forever(self, sleep: Callable[[float], Any] = asyncio.sleep,
                             rng: random.Random | None = None) -> None:
        """Run :meth:`resync_all` every ``config.resync_seconds``, each wait stretched by a random
        share of up to ``config.resync_jitter`` (so replicas and restarts do not line up). The
        first one comes one period after start: a start reconciles everything anyway."""
        rng = rng or random.Random()
        while True:
            await sleep(self.config.resync_seconds * (1 + rng.uniform(0, self.config.resync_jitter)))
            try:
                await self.resync_all()
            except KubeError as exc:
                log.warning("full resync failed, next one in a period: %s", exc)
