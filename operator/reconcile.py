"""Level-triggered reconciliation of InferenceNode and TenantQuota.

Each ``reconcile_*`` reads the world, computes what it should be with the pure builders,
and converges it through :class:`~zerolayer.operator.kube.Kube`: running it again on a
converged cluster writes nothing (and, with the watch-fed cache warm, reads nothing either).
Every write is reported on the custom resource in plain words: one Kubernetes Event per
reconcile lists what it did (warnings get an event each), so the story costs one request,
not one per child.

Errors (the handlers map them to kopf's retry semantics):

- :class:`SpecError` — invalid spec; a person must fix it (kopf ``PermanentError``).
- :class:`WaitingFor` — something outside the operator is missing (the Node, the Secret);
  the status says so and a retry comes after ``delay`` (kopf ``TemporaryError``).
- :class:`~zerolayer.operator.errors.KubeError` — the API failed; kopf retries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
import random
from typing import Any, Callable, Mapping

from zerolayer.operator import conditions as cond
from zerolayer.operator import manifests as m
from zerolayer.operator import validation
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import KubeError, NotFound, NotOwned, OperatorError, SpecError
from zerolayer.operator.kube import Kube, SecretCheck

log = logging.getLogger(__name__)

INODE = (m.API_VERSION, "InferenceNode")
PUBLISHED_MAX_AGE = 300.0
PUBLISH_WINDOW = 1.0  # seconds key-hash entries wait for others to share one write (at most one write a second)
COALESCE_SECONDS = 1.0  # a DaemonSet's status changes within this share one reconcile of its owner
ROLLOUT_SETTLE_SECONDS = 30.0  # ... while its runtime is still coming up (see Reconciler.daemonset_changed)
ROLLING_OUT = frozenset({"RolloutPending", "RollingOut", "PodNotReady"})  # RuntimeReady reasons of that
TQUOTA = (m.API_VERSION, "TenantQuota")


class WaitingFor(OperatorError):
    """A dependency outside the operator is missing; retry after ``delay`` seconds."""

    def __init__(self, message: str, delay: float):
        self.delay = delay
        super().__init__(message)


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _describe(manifest: Mapping[str, Any]) -> str:
    meta = manifest["metadata"]
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{manifest['kind']} {where}{meta['name']}"


@dataclasses.dataclass
class Outcome:
    """What one reconcile did: the actions taken (reported as events) and whether it is Ready."""

    actions: list[str] = dataclasses.field(default_factory=list)
    ready: bool = False
    # (reason, message, warning) for each action, sent by Reconciler._report at the end.
    notes: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)


class Reconciler:
    """Holds the operator's collaborators; one instance per operator process.

    ``node_index`` maps a Kubernetes Node name to the InferenceNodes that claim it, so a
    Node event can be routed to its InferenceNode without a list call. ``selector``: the
    labels an object must carry to be ours (see ``zerolayer operator --selector``).
    """

    def __init__(self, kube: Kube, config: OperatorConfig, *, now: Callable[[], datetime.datetime] = utcnow,
                 observe: Callable[[str, str], None] | None = None, selector: Mapping[str, str] | None = None):
        self.kube = kube
        self.selector = dict(selector or {})
        self.config = config
        self.now = now
        self.observe = observe or (lambda kind, result: None)
        self.node_index: dict[str, set[str]] = collections.defaultdict(set)
        self.missing_nodes: set[str] = set()  # Nodes some InferenceNode waits for
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        # The fleet's published key hashes as last read or written (see _published).
        self._published_keys: dict[str, dict] | None = None
        self._published_raw: dict[str, str] = {}
        self._published_at: datetime.datetime | None = None
        self._pending: dict[str, str | None] = {}  # entries waiting for the next batched write
        self._flush: asyncio.Future | None = None
        self._publish_lock = asyncio.Lock()
        self._soon: dict[tuple[tuple[str, str], str], tuple[asyncio.Task, float]] = {}  # task, due; reconcile_soon
        self._legacy_checked: set[str] = set()  # TenantQuotas whose pre-hash Role/RoleBinding are gone
        self._node_waits: dict[str, asyncio.Task] = {}  # missing Node -> the watch waiting for it

    def _lock(self, kind: str, name: str) -> asyncio.Lock:
        # kopf runs change handlers, timers and our cross-object triggers concurrently;
        # one lock per object keeps two reconciles of it from interleaving.
        return self._locks[f"{kind}/{name}"]

    async def _act(self, body: Mapping[str, Any], outcome: Outcome, reason: str, message: str,
                   warning: bool = False) -> None:
        outcome.actions.append(message)
        outcome.notes.append((reason, message, warning))
        log.info("%s %s: %s", body.get("kind"), body["metadata"]["name"], message)

    async def _report(self, body: Mapping[str, Any], outcome: Outcome) -> None:
        """Send what one reconcile did as events: each warning on its own, every normal action
        in one event (its reason when there is one action, else ``Reconciled``)."""
        normal = [(r, m) for r, m, w in outcome.notes if not w]
        for reason, message, warning in outcome.notes:
            if warning:
                await self.kube.event(body, reason, message, warning=True)
        if normal:
            reason = normal[0][0] if len(normal) == 1 else "Reconciled"
            await self.kube.event(body, reason, "; ".join(m for _, m in normal))
        outcome.notes.clear()

    async def _ensure_all(self, body: Mapping[str, Any], manifests: list[dict], outcome: Outcome) -> dict[str, dict]:
        results = await asyncio.gather(*(self.kube.ensure(x) for x in manifests), return_exceptions=True)
        conflicts = [r for r in results if isinstance(r, NotOwned)]
        if conflicts:
            # Another object's child has our child's name: refuse it, leave it alone, say so.
            message = f"{conflicts[0]}; rename one of the two (their child names collide)"
            kind = INODE if body.get("kind") == "InferenceNode" else TQUOTA
            new = await self._conditions_status(body, kind, [cond.condition("Ready", False, "ChildConflict", message)],
                                                "Degraded")
            await self._note_transition(body, outcome, new, "Degraded")
            raise WaitingFor(message, delay=self.config.retry_seconds)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        objects = {}
        for manifest, (result, obj) in zip(manifests, results):
            objects[manifest["kind"]] = obj
            if result != "unchanged":
                await self._act(body, outcome, result.capitalize(), f"{result.capitalize()} {_describe(manifest)}")
        return objects

    async def _write_status(self, body: Mapping[str, Any], kind: tuple[str, str], status: dict) -> None:
        current = body.get("status") or {}
        if all(current.get(k) == v for k, v in status.items()):
            return  # nothing changed: no write, so a converged reconcile makes reads only
        await self.kube.patch_status(*kind, body["metadata"]["name"], status)

    async def _conditions_status(self, body: Mapping[str, Any], kind: tuple[str, str], updates: list[dict],
                                 phase: str, **extra: Any) -> list[dict]:
        generation = body["metadata"].get("generation")
        previous = (body.get("status") or {}).get("conditions") or []
        merged = cond.merge_conditions(previous, updates, generation=generation, now=self.now())
        await self._write_status(body, kind, {"phase": phase, "observedGeneration": generation,
                                              "conditions": merged, **extra})
        return merged

    async def _note_transition(self, body: Mapping[str, Any], outcome: Outcome, new: list[dict],
                               phase: str) -> None:
        """One event when Ready flips, saying why."""
        old_ready = cond.find((body.get("status") or {}).get("conditions"), "Ready")
        ready = cond.find(new, "Ready")
        if ready and (old_ready is None or old_ready.get("status") != ready["status"]):
            if ready["status"] == cond.TRUE:
                await self._act(body, outcome, "Ready", ready["message"])
            else:
                # Not ready yet while progressing is normal; a warning only when something broke.
                await self._act(body, outcome, ready["reason"], ready["message"],
                                warning=phase in ("Degraded", "Pending"))

    # ================================================================= InferenceNode
    async def reconcile_inference_node(self, body: Mapping[str, Any]) -> Outcome:
        name = body["metadata"]["name"]
        outcome = Outcome()
        async with self._lock("InferenceNode", name):
            body = self.kube.freshest(body)  # a reconcile that held the lock may have moved it on
            try:
                await self._reconcile_inference_node(body, outcome)
            except WaitingFor:
                self.observe("InferenceNode", "waiting")
                raise
            except SpecError:
                self.observe("InferenceNode", "invalid")
                raise
            except OperatorError:
                self.observe("InferenceNode", "error")
                raise
            finally:
                await self._report(body, outcome)
            self.observe("InferenceNode", "ready" if outcome.ready else "progressing")
            return outcome

    async def _reconcile_inference_node(self, body: Mapping[str, Any], outcome: Outcome) -> Outcome:
        meta, spec = body["metadata"], body.get("spec") or {}
        name = meta["name"]
        problems = validation.inference_node_problems(spec)
        if problems:
            new = await self._conditions_status(body, INODE, [
                cond.condition("Ready", False, "InvalidSpec", "; ".join(problems))], "Degraded")
            await self._note_transition(body, outcome, new, "Degraded")
            raise SpecError(problems)
        problems = validation.engine_args_problems(spec)
        if problems:
            # Before any child is written: the running runtime keeps its last good spec.
            message = "; ".join(problems)
            await self._conditions_status(body, INODE, [cond.condition("Ready", False, "InvalidEngineArgs", message)],
                                          "Degraded")
            await self._act(body, outcome, "InvalidEngineArgs", message, warning=True)
            raise SpecError(problems)

        node_name = spec["nodeName"]
        for other, nodes in list(self.node_index.items()):
            nodes.discard(name)
            if not nodes and other != node_name:  # nobody waits for that Node any more
                del self.node_index[other]
                self.missing_nodes.discard(other)
                self._stop_awaiting(other)
        self.node_index[node_name].add(name)

        node = await self.kube.get("v1", "Node", node_name, cached=self._node_copy_will_do(name))
        if node is None:
            self.missing_nodes.add(node_name)
            self._await_node(node_name)
            message = f"Kubernetes Node {node_name} does not exist; waiting for it to join the cluster"
            new = await self._conditions_status(body, INODE, [
                cond.condition("NodeFound", False, "NodeMissing", message),
                cond.condition("NodeLabelled", False, "NodeMissing", message),
                cond.condition("Ready", False, "NodeMissing", message),
            ], "Pending")
            await self._note_transition(body, outcome, new, "Pending")
            raise WaitingFor(message, delay=self.config.retry_seconds)

        self.missing_nodes.discard(node_name)
        self._stop_awaiting(node_name)
        # One InferenceNode per Node: a second one would run a second runtime on the same GPUs.
        claimed_by = (node.get("metadata", {}).get("annotations") or {}).get(m.CLAIM_ANNOTATION)
        if claimed_by and claimed_by != name:
            other = await self.kube.get(*INODE, claimed_by)
            if other is not None and not other["metadata"].get("deletionTimestamp"):
                message = f"node {node_name} is already served by InferenceNode {claimed_by}"
                new = await self._conditions_status(body, INODE, [
                    cond.condition("NodeFound", True, "NodeExists", f"Kubernetes Node {node_name} exists"),
                    cond.condition("NodeLabelled", False, "NodeClaimed", message),
                    cond.condition("Ready", False, "NodeClaimed", message),
                ], "Degraded")
                await self._note_transition(body, outcome, new, "Degraded")
                raise WaitingFor(message, delay=self.config.retry_seconds)

        # Label the node: this is what places the runtime there.
        gpu_type = m.gpu_type_of(spec, node)
        wanted = m.node_labels(gpu_type)
        have = node.get("metadata", {}).get("labels") or {}
        missing = {k: v for k, v in wanted.items() if have.get(k) != v}
        if missing or claimed_by != name:
            await self.kube.patch_metadata("v1", "Node", node_name, labels=missing,
                                           annotations={m.CLAIM_ANNOTATION: name})
        if missing:
            await self._act(body, outcome, "NodeLabelled", f"Labelled node {node_name} with " +
                            ", ".join(f"{k}={v}" for k, v in sorted(missing.items())))

        children = [
            m.build_serviceaccount(body, self.config),
            m.build_clusterrole(body, self.config),
            m.build_clusterrolebinding(body, self.config),
            m.build_headless_service(body, self.config),
            m.build_runtime_networkpolicy(body, self.config),
            m.build_keys_role(body, self.config),
            m.build_keys_rolebinding(body, self.config),
        ]
        labelled = f"node {node_name} carries " + ", ".join(f"{k}={v}" for k, v in sorted(wanted.items()))
        node_parts = [cond.condition("NodeFound", True, "NodeExists", f"Kubernetes Node {node_name} exists"),
                      cond.condition("NodeLabelled", True, "Labelled", labelled)]
        missing = await self._missing_model_storage(spec)
        if missing:
            # Hold the runtime pod back: a pod whose claim or token Secret is missing would only
            # sit in Pending/ContainerCreating. An existing DaemonSet keeps its previous spec, so
            # the pod that serves now keeps serving until the storage exists.
            await self._ensure_all(body, children, outcome)
            models = cond.condition("ModelsReady", False, *missing)
            new = await self._conditions_status(body, INODE, node_parts + [
                models, cond.condition("Ready", False, *missing)], "Pending")
            await self._note_models(body, outcome, new)
            await self._note_transition(body, outcome, new, "Pending")
            raise WaitingFor(missing[1], delay=self.config.retry_seconds)

        allocatable = ((node.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
        node_gpus = int(allocatable) if str(allocatable or "").isdigit() else None
        kernel = ((node.get("status") or {}).get("nodeInfo") or {}).get("kernelVersion")
        objects = await self._ensure_all(body, children + [m.build_daemonset(body, self.config, node_gpus, kernel)],
                                         outcome)
        runtime_ready = self._runtime_condition(objects["DaemonSet"], node_name)
        models = await self._models_condition(spec, name, runtime_ready)
        gossip = self._gossip_condition(body)
        parts = node_parts + [models, runtime_ready, gossip]
        not_ready = [c for c in parts if c["status"] != cond.TRUE]
        if not_ready:
            # A failure explains more than a state not known yet.
            first = next((c for c in not_ready if c["status"] == cond.FALSE), not_ready[0])
            ready = cond.condition("Ready", False, first["reason"], first["message"])
            broken = gossip["status"] == cond.FALSE or models["status"] == cond.FALSE
            phase = "Degraded" if broken else "Progressing"
        else:
            ready = cond.condition("Ready", True, "RuntimeServing",
                                   f"runtime is ready on node {node_name} and publishing its GPU map")
            phase = "Ready"
        new = await self._conditions_status(body, INODE, parts + [ready], phase)
        await self._note_models(body, outcome, new)
        await self._note_transition(body, outcome, new, phase)
        outcome.ready = not not_ready
        if models["status"] != cond.TRUE:
            # Neither a download's progress nor its failure changes the DaemonSet's status (which
            # is what triggers reconciles): look at the pod again soon.
            raise WaitingFor(models["message"], delay=min(15.0, self.config.retry_seconds))
        return outcome

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

    async def _models_condition(self, spec: Mapping[str, Any], name: str, runtime_ready: Mapping[str, Any]) -> dict:
        """ModelsReady: mounted, still downloading, or a download that failed (from the pod's
        init-container statuses, read only while the runtime is not ready and a model is downloaded)."""
        fetches = {c["name"] for c in m.build_model_storage(spec, "-", "-").init_containers}
        if fetches and runtime_ready["status"] != cond.TRUE:
            selector = ",".join(f"{k}={v}" for k, v in sorted(m.runtime_selector(name).items()))
            pods = await self.kube.list("v1", "Pod", self.config.runtime_namespace, label_selector=selector)
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

    async def _note_models(self, body: Mapping[str, Any], outcome: Outcome, new: list[dict]) -> None:
        """One warning event when ModelsReady turns False or its reason changes, saying why."""
        old = cond.find((body.get("status") or {}).get("conditions"), "ModelsReady")
        now = cond.find(new, "ModelsReady")
        if now and now["status"] == cond.FALSE and (old is None or (old.get("status"), old.get("reason"))
                                                     != (now["status"], now["reason"])):
            await self._act(body, outcome, now["reason"], now["message"], warning=True)

    @staticmethod
    def _runtime_condition(daemonset: Mapping[str, Any], node_name: str) -> dict:
        status = daemonset.get("status") or {}
        meta = daemonset.get("metadata") or {}
        desired = status.get("desiredNumberScheduled", 0)
        ready = status.get("numberReady", 0)
        updated = status.get("updatedNumberScheduled", 0)
        observed = status.get("observedGeneration", 0)
        if observed < meta.get("generation", 1):
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

    def _gossip_condition(self, body: Mapping[str, Any]) -> dict:
        stale_after = int(((body.get("spec") or {}).get("gossip") or {}).get("staleAfterSeconds", 30))
        beat = _parse_time((body.get("status") or {}).get("lastHeartbeat"))
        if beat is None:
            return cond.condition("GossipFresh", cond.UNKNOWN, "NoHeartbeat",
                                  "the runtime has not published its GPU map yet")
        age = (self.now() - beat).total_seconds()
        if age > stale_after:
            return cond.condition("GossipFresh", False, "HeartbeatStale",
                                  f"last GPU-map heartbeat is older than {stale_after}s")
        return cond.condition("GossipFresh", True, "HeartbeatRecent",
                              f"GPU-map heartbeat within the last {stale_after}s")

    async def delete_inference_node(self, body: Mapping[str, Any]) -> Outcome:
        """Finalizer work: remove the node labels and every child (owner references would
        collect the children too; deleting them here makes removal prompt and visible)."""
        outcome = Outcome()
        name = body["metadata"]["name"]
        try:
            await self._delete_inference_node(body, name, outcome)
        finally:
            await self._report(body, outcome)
        self._locks.pop(f"InferenceNode/{name}", None)
        return outcome

    async def _delete_inference_node(self, body: Mapping[str, Any], name: str, outcome: Outcome) -> None:
        async with self._lock("InferenceNode", name):
            if (body.get("status") or {}).get("phase") != "Terminating":
                try:
                    await self.kube.patch_status(*INODE, name, {"phase": "Terminating"})
                except NotFound:
                    pass  # already gone: nothing left to show
            node_name = (body.get("spec") or {}).get("nodeName")
            if node_name:
                self.node_index[node_name].discard(name)
                if not self.node_index[node_name]:
                    self.node_index.pop(node_name, None)
                    self.missing_nodes.discard(node_name)
                    self._stop_awaiting(node_name)
                node = await self.kube.get("v1", "Node", node_name)
                meta = (node or {}).get("metadata", {})
                labels, claimed_by = meta.get("labels") or {}, (meta.get("annotations") or {}).get(m.CLAIM_ANNOTATION)
                ours = [k for k in (m.INFERENCE_NODE_LABEL, m.GPU_TYPE_LABEL) if k in labels]
                # Only the InferenceNode that claimed the node unlabels it (a refused second one
                # must not take the runtime away from the first).
                if node is not None and claimed_by in (name, None):
                    if ours or claimed_by:
                        await self.kube.patch_metadata("v1", "Node", node_name, labels={k: None for k in ours},
                                                       annotations={m.CLAIM_ANNOTATION: None} if claimed_by else None)
                    if ours:
                        await self._act(body, outcome, "NodeUnlabelled",
                                        f"Removed labels {', '.join(ours)} from node {node_name}")
            child = m.runtime_name(name)
            ns = self.config.runtime_namespace
            for api_version, kind, namespace in (
                ("apps/v1", "DaemonSet", ns), ("v1", "Service", ns), ("networking.k8s.io/v1", "NetworkPolicy", ns),
                ("rbac.authorization.k8s.io/v1", "RoleBinding", ns), ("rbac.authorization.k8s.io/v1", "Role", ns),
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None),
                ("rbac.authorization.k8s.io/v1", "ClusterRole", None), ("v1", "ServiceAccount", ns),
            ):
                if await self._delete_owned(body, api_version, kind, child, namespace):
                    where = f"{namespace}/" if namespace else ""
                    await self._act(body, outcome, "Deleted", f"Deleted {kind} {where}{child}")

    async def _delete_owned(self, body: Mapping[str, Any], api_version: str, kind: str, name: str,
                            namespace: str | None) -> bool:
        """Delete a child by name unless another object controls it (see manifests.foreign_controller)."""
        current = await self.kube.get(api_version, kind, name, namespace)
        if current is None:
            return False
        other = m.foreign_controller(current, body["metadata"].get("uid"))
        if other is not None:
            log.warning("%s %s: not deleting %s %s, it belongs to %s", body.get("kind"), body["metadata"]["name"],
                        kind, name, other)
            return False
        return await self.kube.delete(api_version, kind, name, namespace)

    # ================================================================= TenantQuota
    async def reconcile_tenant_quota(self, body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Outcome:
        name = body["metadata"]["name"]
        outcome = Outcome()
        async with self._lock("TenantQuota", name):
            body = self.kube.freshest(body)
            try:
                await self._reconcile_tenant_quota(body, old, outcome)
            except WaitingFor:
                self.observe("TenantQuota", "waiting")
                raise
            except SpecError:
                self.observe("TenantQuota", "invalid")
                raise
            except OperatorError:
                self.observe("TenantQuota", "error")
                raise
            finally:
                await self._report(body, outcome)
            self.observe("TenantQuota", "ready" if outcome.ready else "progressing")
            return outcome

    async def _reconcile_tenant_quota(self, body: Mapping[str, Any], old: Mapping[str, Any] | None,
                                      outcome: Outcome) -> Outcome:
        spec = body.get("spec") or {}
        name = body["metadata"]["name"]
        namespace, secret, key = m.secret_ref(body, self.config)
        problems = validation.tenant_quota_problems(spec)
        if not problems and not m.secret_namespace_allowed(body, self.config):
            problems = [f"apiKeySecretRef.namespace {namespace!r} is not one of the tenant's namespaces, the "
                        "runtime namespace or the operator's tenant Secret namespaces"]
        if problems:
            await self._unpublish(name)
            reason = "InvalidSpec" if validation.tenant_quota_problems(spec) else "SecretNamespaceNotAllowed"
            new = await self._conditions_status(body, TQUOTA, [
                cond.condition("Ready", False, reason, "; ".join(problems))], "Degraded", keyCount=0)
            await self._note_transition(body, outcome, new, "Degraded")
            raise SpecError(problems)

        problem = await self._secret_problem(namespace, secret, key)
        check = problem if isinstance(problem, SecretCheck) else None
        if check is None:
            # Not served until its keys can be read: the runtimes drop the tenant at their next sync.
            await self._unpublish(name)
            new = await self._conditions_status(body, TQUOTA, [
                cond.condition("SecretFound", False, *problem),
                cond.condition("Ready", False, *problem)], "Pending", keyCount=0)
            await self._note_transition(body, outcome, new, "Pending")
            raise WaitingFor(problem[1], delay=min(10.0, self.config.retry_seconds))
        secret_found = cond.condition("SecretFound", True, "SecretFound",
                                      f"API-key Secret {namespace}/{secret} holds {check.key_count} key(s)")

        clash = await self._duplicate_of(body, check.key_hashes)
        if clash is not None:
            reason, other, message = clash
            await self._unpublish(name)
            new = await self._conditions_status(body, TQUOTA, [
                secret_found, cond.condition("Ready", False, reason, message)], "Degraded", keyCount=check.key_count)
            await self._note_transition(body, outcome, new, "Degraded")
            await self.kube.event({"apiVersion": m.API_VERSION, "kind": "TenantQuota", "metadata": {"name": other}},
                                  reason, f"TenantQuota {name} was refused: {message}", warning=True)
            raise WaitingFor(message, delay=self.config.retry_seconds)
        await self._publish(name, m.build_tenant_key_entry(body, list(check.key_hashes)))
        await self._remove_legacy_secret_access(body, outcome)

        cilium = await self.kube.crd_exists(m.CILIUM_CRD)
        policy = m.build_ciliumnetworkpolicy(body, self.config) if cilium else \
            m.build_tenant_networkpolicy(body, self.config)
        await self._ensure_all(body, [policy], outcome)
        if cilium:
            # The L7 policy replaces the plain one (see build_ciliumnetworkpolicy).
            child = m.tenant_name(name)
            if await self.kube.delete("networking.k8s.io/v1", "NetworkPolicy", child, self.config.runtime_namespace):
                await self._act(body, outcome, "Deleted", f"Deleted NetworkPolicy {self.config.runtime_namespace}/"
                                f"{child} (replaced by a CiliumNetworkPolicy with L7 rules)")
        kind = "CiliumNetworkPolicy" if cilium else "NetworkPolicy"
        namespaces = ", ".join(sorted(set(spec["namespaces"])))
        applied = cond.condition("PoliciesApplied", True, "PoliciesApplied",
                                 f"{kind} {policy['metadata']['name']} admits namespaces {namespaces} "
                                 "to the runtimes' serving port")
        ready = cond.condition("Ready", True, "TenantAdmitted",
                               f"tenant {spec['tenant']} can reach the runtimes from {namespaces}")
        new = await self._conditions_status(body, TQUOTA, [secret_found, applied, ready], "Ready",
                                            keyCount=check.key_count,
                                            networkPolicies=[policy["metadata"]["name"]])
        await self._note_transition(body, outcome, new, "Ready")
        outcome.ready = True
        return outcome

    async def _secret_problem(self, namespace: str, secret: str, key: str) -> "SecretCheck | tuple[str, str]":
        """The Secret's check, or (reason, message) of why its keys cannot be used.

        403 counts like 404 (RBAC is checked before existence): the tenant waits with a
        condition instead of failing the reconcile. Messages name the Secret and the entry,
        never anything read from it."""
        try:
            check = await self.kube.check_secret(namespace, secret, key)
        except KubeError as exc:
            if exc.status != 403:
                raise
            return ("SecretUnreadable", f"the operator may not read API-key Secret {namespace}/{secret} (403)")
        if not check.found:
            return ("SecretMissing", f"API-key Secret {namespace}/{secret} does not exist")
        if not check.has_key:
            return ("KeyMissing", f"API-key Secret {namespace}/{secret} has no entry {key!r}")
        if check.key_count == 0:
            return ("NoKeys", f"entry {key!r} of API-key Secret {namespace}/{secret} holds no keys")
        return check

    async def _published(self) -> dict[str, dict]:
        """The fleet's published key hashes by TenantQuota name, re-read at most every
        ``PUBLISHED_MAX_AGE`` seconds and at each full resync (1,000 TenantQuotas must not mean
        1,000 reads of one large Secret; the leader is its only writer, so our copy stays right)."""
        age = self.now() - self._published_at if self._published_at is not None else None
        if self._published_keys is None or age is None or age.total_seconds() > PUBLISHED_MAX_AGE:
            raw = await self.kube.read_published_keys(self.config.runtime_namespace)
            self._published_keys = {k: e for k, e in ((k, m.read_tenant_key_entry(v)) for k, v in raw.items())
                                    if e is not None}
            self._published_raw = dict(raw)
            self._published_at = self.now()
        return self._published_keys

    async def _publish(self, name: str, entry: str | None) -> None:
        """Set (or with None remove) one TenantQuota's entry in the key-hash Secret; returns once
        it is written. Entries that arrive within ``PUBLISH_WINDOW`` of each other go out in one
        merge patch (1,000 TenantQuotas created together cost a handful of writes, not 1,000)."""
        await self._published()
        if self._published_raw.get(name) == entry and name not in self._pending:
            return  # unchanged: a converged reconcile writes nothing
        self._pending[name] = entry
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._flush_pending())
        # shield: one caller's cancellation must not cancel the write the others wait for
        await asyncio.shield(self._flush)

    async def _flush_pending(self) -> None:
        await asyncio.sleep(PUBLISH_WINDOW)
        # One write of the Secret at a time (group commit): concurrent merge patches of one object
        # make the API server retry them against each other. Entries that arrive while a write
        # is in flight gather in the next batch, which goes out when that write is done.
        async with self._publish_lock:
            batch, self._pending, self._flush = self._pending, {}, None  # later entries: next batch
            await self.kube.publish_keys(self.config.runtime_namespace, batch)
        for name, entry in batch.items():
            if entry is None:
                self._published_raw.pop(name, None)
                self._published_keys.pop(name, None)
            else:
                self._published_raw[name] = entry
                self._published_keys[name] = m.read_tenant_key_entry(entry)

    async def _unpublish(self, name: str) -> None:
        await self._publish(name, None)

    async def _duplicate_of(self, body: Mapping[str, Any], hashes: tuple[str, ...]) -> tuple[str, str, str] | None:
        """(reason, other TenantQuota, message) when an older TenantQuota already holds this tenant
        name or one of these keys; the older one (creationTimestamp, then name) keeps them, so every
        operator and runtime picks the same winner."""
        name = body["metadata"]["name"]
        tenant = body["spec"]["tenant"]
        mine = (body["metadata"].get("creationTimestamp") or "", name)
        for other, entry in sorted((await self._published()).items()):
            if other == name or (entry["created"], other) > mine:
                continue
            if entry["tenant"] == tenant:
                return ("DuplicateTenant", other,
                        f"tenant {tenant!r} is already declared by the older TenantQuota {other}")
            if set(entry["hashes"]) & set(hashes):
                return ("DuplicateKey", other,
                        f"an API key of this tenant is also a key of the older TenantQuota {other} "
                        f"(tenant {entry['tenant']!r}); keys must be unique")
        return None

    async def _remove_legacy_secret_access(self, body: Mapping[str, Any], outcome: Outcome) -> None:
        """Before runtimes got hashes, each TenantQuota had a Role and RoleBinding ``zl-tenant-<name>``
        letting the runtime namespace read its Secret. Remove them once per operator process."""
        name = body["metadata"]["name"]
        if name in self._legacy_checked or not (body.get("status") or {}).get("conditions"):
            # A TenantQuota with no status was never reconciled, so no older operator made them.
            self._legacy_checked.add(name)
            return
        namespace = m.secret_ref(body, self.config)[0]
        child = m.tenant_name(name)
        for kind in ("RoleBinding", "Role"):
            if await self.kube.delete("rbac.authorization.k8s.io/v1", kind, child, namespace):
                await self._act(body, outcome, "Deleted", f"Deleted {kind} {namespace}/{child} (runtimes no "
                                "longer read tenants' Secrets)")
        self._legacy_checked.add(name)

    async def delete_tenant_quota(self, body: Mapping[str, Any]) -> Outcome:
        outcome = Outcome()
        name = body["metadata"]["name"]
        child = m.tenant_name(name)
        try:
            await self._delete_tenant_quota(body, name, child, outcome)
        finally:
            await self._report(body, outcome)
        self._locks.pop(f"TenantQuota/{name}", None)
        self._legacy_checked.discard(name)
        return outcome

    async def _delete_tenant_quota(self, body: Mapping[str, Any], name: str, child: str, outcome: Outcome) -> None:
        async with self._lock("TenantQuota", name):
            await self._unpublish(name)
            secret_ns = m.secret_ref(body, self.config)[0]
            targets = [("networking.k8s.io/v1", "NetworkPolicy", self.config.runtime_namespace),
                       ("rbac.authorization.k8s.io/v1", "RoleBinding", secret_ns),
                       ("rbac.authorization.k8s.io/v1", "Role", secret_ns)]
            if await self.kube.crd_exists(m.CILIUM_CRD):
                targets.insert(0, ("cilium.io/v2", "CiliumNetworkPolicy", self.config.runtime_namespace))
            for api_version, kind, namespace in targets:
                if await self._delete_owned(body, api_version, kind, child, namespace):
                    await self._act(body, outcome, "Deleted", f"Deleted {kind} {namespace}/{child}")

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
        if not self._selected(body):
            return None
        return await self.reconcile_inference_node(body)

    async def reconcile_tenant_quota_by_name(self, name: str) -> Outcome | None:
        body = await self.kube.get(*TQUOTA, name, cached=True)
        if not self._selected(body):
            return None
        return await self.reconcile_tenant_quota(body)

    # ================================================================= Nodes
    # No watch follows every Node: kwok (and kubelets, less often) rewrite each Node's status every
    # few seconds, and at 200 Nodes receiving those events cost the operator 2-10 % of a core while
    # nothing else moved. The DaemonSet controller watches Nodes anyway: a Node that disappears or
    # loses the inference-node label makes its runtime DaemonSet unscheduled (desiredNumberScheduled
    # 0 at the current spec), and that status change reaches the operator through its DaemonSet
    # watch. So a Node is read from the API server when its DaemonSet says so (or when no copy of it
    # from our own reads and writes is left), and a Node an InferenceNode waits for is watched by
    # name until it appears.
    def _node_copy_will_do(self, name: str) -> bool:
        """False when the watch-fed cache shows this InferenceNode's runtime DaemonSet, at its
        latest spec, scheduled nowhere: its Node went away or lost the label, so a remembered copy
        of the Node would hide that. Otherwise (scheduled there, or not yet seen by the DaemonSet
        controller, whose verdict will come as a DaemonSet event) a copy will do."""
        ds = self.kube.peek(("apps/v1", "DaemonSet", self.config.runtime_namespace, m.runtime_name(name)))
        if ds is None:
            return True
        status = ds.get("status") or {}
        observed = status.get("observedGeneration", 0) >= (ds.get("metadata") or {}).get("generation", 1)
        return not (observed and status.get("desiredNumberScheduled", 0) == 0)

    def _await_node(self, node_name: str) -> None:
        """Watch for the missing Node by name (one watch per missing Node, closed once it
        appears); when it does, reconcile the InferenceNodes that claim it at once."""
        if node_name not in self._node_waits:
            self._node_waits[node_name] = asyncio.get_running_loop().create_task(
                self._node_appears(node_name), name=f"wait for node {node_name}")

    def _stop_awaiting(self, node_name: str) -> None:
        task = self._node_waits.pop(node_name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _node_appears(self, node_name: str) -> None:
        try:
            async with contextlib.aclosing(self.kube.watch_stream(
                    "v1", "Node", field_selector=f"metadata.name={node_name}")) as events:
                async for event_type, _node in events:
                    if event_type in ("ADDED", "MODIFIED"):
                        break
                else:
                    return
        finally:
            if self._node_waits.get(node_name) is asyncio.current_task():
                del self._node_waits[node_name]
        for name in sorted(self.node_index.get(node_name) or ()):
            self.reconcile_soon(INODE, name, delay=0.0)

    # ================================================================= coalesced triggers
    def reconcile_soon(self, kind: tuple[str, str], name: str, delay: float = COALESCE_SECONDS) -> None:
        """Reconcile the named object ``delay`` seconds from now, in the background; requests
        for it until then join that one (it reads the newest cached state when it runs), and a
        request due sooner than the pending one moves it earlier. For bursts of events that
        each change little, e.g. a DaemonSet's status moving through scheduled, updated and
        ready. A reconcile that must wait or fails is scheduled again after its delay, as kopf
        would retry it."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._soon.get((kind, name))
        if pending is not None:
            if pending[1] <= due:
                return
            pending[0].cancel()  # still sleeping (a task leaves _soon before it reconciles)
        self._soon[(kind, name)] = (loop.create_task(self._later(kind, name, delay)), due)

    def daemonset_changed(self, owner: str, daemonset: Mapping[str, Any]) -> None:
        """A runtime DaemonSet's status moved: reconcile its InferenceNode once per burst.

        While the runtime is still coming up (the rollout not yet seen, pods not yet updated or
        not yet ready) the owner is reconciled only ``ROLLOUT_SETTLE_SECONDS`` later, unless the
        runtime becomes ready (or is not scheduled at all) first: each intermediate state would
        otherwise be one more status write per InferenceNode (measured: about two per node
        at 200 nodes), and none of them changes Ready."""
        reason = self._runtime_condition(daemonset, "")["reason"]
        self.reconcile_soon(INODE, owner, ROLLOUT_SETTLE_SECONDS if reason in ROLLING_OUT else COALESCE_SECONDS)

    async def _later(self, kind: tuple[str, str], name: str, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            # Events from here on schedule a new one (unless this one was replaced by a sooner one).
            if self._soon.get((kind, name), (None,))[0] is asyncio.current_task():
                del self._soon[(kind, name)]
        by_name = self.reconcile_inference_node_by_name if kind == INODE else self.reconcile_tenant_quota_by_name
        try:
            await by_name(name)
        except WaitingFor as exc:
            self.reconcile_soon(kind, name, exc.delay)
        except KubeError as exc:
            log.info("%s %s: %s; again in a moment", kind[1], name, exc)
            self.reconcile_soon(kind, name, 2.0 if exc.retryable else self.config.retry_seconds)
        except SpecError:
            pass  # the status says why; a spec change triggers the next reconcile

    async def close(self) -> None:
        """Cancel the background reconciles still waiting to run and the watches for missing Nodes."""
        tasks = [task for task, _ in self._soon.values()] + list(self._node_waits.values())
        self._node_waits.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._soon.clear()  # a task cancelled before it ever ran did not remove itself

    # ================================================================= the full resync
    async def resync_all(self) -> dict[str, int]:
        """Re-read every selected InferenceNode and TenantQuota from the API server (the cache is
        dropped first, so children and Nodes are re-read too) and reconcile each, one at a time:
        repairs drift that no watch saw. Returns counts by result; one object's failure is
        logged and does not stop the rest (kopf retries it on its own events)."""
        self.kube.forget()
        self._published_keys = None
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
