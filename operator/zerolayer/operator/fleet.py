"""The InferenceFleet reconciler: lock, read through the kube layer, plan (:mod:`.fleet_plan`), apply.

A fleet is looked at when it is created or its spec changes, when the operator starts, and every
:data:`SYNC_SECONDS` by a kopf timer (the autoscaler's period, and how soon a lost InferenceNode is
replaced). A look that changes nothing costs no API request: the InferenceNodes come from the
operator's watch cache. Only a plan that writes (creates, deletes or scales) is planned again from a
fresh list of the InferenceNodes, and, when it places, of the Nodes matching ``nodeSelector``, so a
cache that has not caught up never makes a second InferenceNode for one Node.

A plan's ``retry`` (a busy node still to drain, a rollout step, a missing Node) is met by that timer: the
next look comes within :data:`SYNC_SECONDS`, so shorter delays are rounded up to it.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
from typing import Any, Callable, Mapping

from zerolayer.operator import conditions as cond
from zerolayer.operator import fleet_plan
from zerolayer.operator import manifests as m
from zerolayer.operator.errors import NotOwned, SpecError
from zerolayer.operator.kube import MERGE_PATCH, Kube, is_subset, path_of

SYNC_SECONDS = 10.0
KIND = fleet_plan.KIND


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class FleetReconciler:
    """Reconciles InferenceFleets through ``kube``; ``observe(kind, result)`` counts reconciles."""

    def __init__(self, kube: Kube, *, now: Callable[[], datetime.datetime] = utcnow,
                 observe: Callable[[str, str], None] = lambda kind, result: None) -> None:
        self.kube = kube
        self.now = now
        self.observe = observe
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    async def reconcile(self, body: Mapping[str, Any]) -> fleet_plan.FleetPlan:
        """One reconcile; raises SpecError for an invalid spec (after writing its status)."""
        async with self._locks[body["metadata"]["name"]]:
            body = self.kube.freshest(body)
            plan = fleet_plan.plan_inference_fleet(body, None, self.kube.seen_all(m.API_VERSION, "InferenceNode"),
                                                   self.now())
            if plan.needs_nodes or plan.writes:
                inodes = await self.kube.list(m.API_VERSION, "InferenceNode")
                selector = ",".join(f"{k}={v}" for k, v in sorted(((body.get("spec") or {}).get("nodeSelector")
                                                                   or {}).items()))
                nodes = await self.kube.list("v1", "Node", label_selector=selector or None)
                plan = fleet_plan.plan_inference_fleet(body, nodes, inodes, self.now())
            await self._apply(body, plan)
            self.observe(KIND, "invalid" if plan.invalid else plan.phase or "unknown")
            return plan

    async def _apply(self, body: Mapping[str, Any], plan: fleet_plan.FleetPlan) -> None:
        name = body["metadata"]["name"]
        if plan.scale_to is not None:
            # spec.replicas is the scale subresource's field: kubectl, HPA and this autoscaler share it.
            await self.kube.request("PATCH", path_of(m.API_VERSION, KIND, None, name),
                                    body={"spec": {"replicas": plan.scale_to}}, content_type=MERGE_PATCH)
        for child in plan.children:
            try:
                await self.kube.ensure(child)
            except NotOwned as exc:
                plan.notes.append(fleet_plan.Note("NotOwned", str(exc), warning=True))
        for removal in plan.removals:
            await self.kube.delete(removal.api_version, removal.kind, removal.name, removal.namespace)
        status = dict(plan.status)
        previous = (body.get("status") or {})
        if plan.phase is not None:
            status["phase"] = plan.phase
            status["conditions"] = cond.merge_conditions(previous.get("conditions"), plan.conditions,
                                                         generation=body["metadata"].get("generation"),
                                                         now=self.now())
        if not is_subset(status, previous):
            await self.kube.patch_status(m.API_VERSION, KIND, name, status)
        for note in plan.notes:
            await self.kube.event(body, note.reason, note.message, warning=note.warning)
        if plan.invalid:
            raise SpecError(plan.invalid)
