"""Carrying out a :class:`~.plan.Plan` through the kube layer, and telling what was done.

Every write is reported on the custom resource in plain words: one Kubernetes Event per reconcile
lists what it did (warnings get an event each), so the story costs one request, not one per child.
A converged object costs no write: children that match are left alone (``Kube.ensure``) and a
status that did not change is not patched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from typing import Any, Callable, Mapping

from zerolayer.operator import conditions as cond
from zerolayer.operator import manifests as m
from zerolayer.operator.errors import NotOwned, SpecError, WaitingFor
from zerolayer.operator.keys import KeyPublisher
from zerolayer.operator.kube import Kube
from zerolayer.operator.plan import Plan, transition_notes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Outcome:
    """What one reconcile did: the actions taken (reported as events) and whether it is Ready."""

    actions: list[str] = dataclasses.field(default_factory=list)
    ready: bool = False
    # (reason, message, warning) for each action, sent by Applier.report at the end.
    notes: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)


def describe(manifest: Mapping[str, Any]) -> str:
    meta = manifest["metadata"]
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{manifest['kind']} {where}{meta['name']}"


# The order children are written in. Kubernetes refuses a binding to a role that does not exist yet
# from a client that may not ``bind`` (the operator may not: it may grant only what it holds), so
# roles go before their bindings; and the runtime pod, which needs both from its first request,
# goes last. Kinds not named here are in the first wave.
WAVES = {"RoleBinding": 1, "ClusterRoleBinding": 1, "DaemonSet": 2}


class Applier:
    """Applies plans for one operator process: ``keys`` takes publications, ``now`` stamps conditions."""

    def __init__(self, kube: Kube, keys: KeyPublisher, now: Callable[[], datetime.datetime], retry_seconds: float):
        self.kube = kube
        self.keys = keys
        self.now = now
        self.retry_seconds = retry_seconds

    def note(self, body: Mapping[str, Any], outcome: Outcome, reason: str, message: str,
             warning: bool = False) -> None:
        outcome.actions.append(message)
        outcome.notes.append((reason, message, warning))
        log.info("%s %s: %s", body.get("kind"), body["metadata"]["name"], message)

    async def report(self, body: Mapping[str, Any], outcome: Outcome) -> None:
        """Send what one reconcile did as events: each warning on its own, every normal action
        in one event (its reason when there is one action, else ``Reconciled``)."""
        normal = [(r, msg) for r, msg, w in outcome.notes if not w]
        for reason, message, warning in outcome.notes:
            if warning:
                await self.kube.event(body, reason, message, warning=True)
        if normal:
            reason = normal[0][0] if len(normal) == 1 else "Reconciled"
            await self.kube.event(body, reason, "; ".join(msg for _, msg in normal))
        outcome.notes.clear()

    async def apply(self, body: Mapping[str, Any], plan: Plan, outcome: Outcome) -> dict[str, dict]:
        """Do what ``plan`` says, in its order; returns the children as applied, by kind. Raises
        :class:`SpecError` for ``plan.invalid`` and :class:`WaitingFor` for ``plan.retry``, after
        the status says why."""
        if plan.publication is not None:
            await self.keys.publish(body["metadata"]["name"], plan.publication.entry)
        for patch in plan.patches:
            await self.kube.patch_metadata(patch.api_version, patch.kind, patch.name, namespace=patch.namespace,
                                           labels=patch.labels, annotations=patch.annotations)
            if patch.note is not None:
                self.note(body, outcome, patch.note.reason, patch.note.message, patch.note.warning)
        objects = await self.ensure_all(body, plan.children, outcome) if plan.children else {}
        for removal in plan.removals:
            if await self.kube.delete(removal.api_version, removal.kind, removal.name, removal.namespace):
                self.note(body, outcome, "Deleted", removal.message)
        if plan.settled:
            await self.status(body, plan.conditions, plan.phase or "", **plan.status)
            for note in plan.notes:
                if note.about is not None:
                    await self.kube.event(note.about, note.reason, note.message, warning=note.warning)
                else:
                    self.note(body, outcome, note.reason, note.message, note.warning)
        outcome.ready = plan.ready
        if plan.invalid:
            raise SpecError(plan.invalid)
        if plan.retry is not None:
            raise WaitingFor(plan.retry.message, delay=plan.retry.delay)
        return objects

    async def ensure_all(self, body: Mapping[str, Any], manifests: list[dict], outcome: Outcome) -> dict[str, dict]:
        results = await self._ensure_in_waves(manifests)
        conflicts = [r for r in results if isinstance(r, NotOwned)]
        if conflicts:
            # Another object's child has our child's name: refuse it, leave it alone, say so.
            message = f"{conflicts[0]}; rename one of the two (their child names collide)"
            updates = [cond.condition("Ready", False, "ChildConflict", message)]
            await self.status(body, updates, "Degraded")
            for note in transition_notes(body, updates, "Degraded"):
                self.note(body, outcome, note.reason, note.message, note.warning)
            raise WaitingFor(message, delay=self.retry_seconds)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        objects = {}
        for manifest, applied in zip(manifests, results):
            assert not isinstance(applied, BaseException)
            result, objects[manifest["kind"]] = applied
            if result != "unchanged":
                self.note(body, outcome, result.capitalize(), f"{result.capitalize()} {describe(manifest)}")
        return objects

    async def _ensure_in_waves(self, manifests: list[dict]) -> list[Any]:
        """Ensure ``manifests`` wave by wave (:data:`WAVES`), each wave's writes at once; a wave with a
        failure ends it there (the later ones wait for the retry). Results are in ``manifests``' order,
        ``None`` for what was not attempted."""
        results: list[Any] = [None] * len(manifests)
        for wave in sorted({WAVES.get(x["kind"], 0) for x in manifests}):
            picked = [i for i, x in enumerate(manifests) if WAVES.get(x["kind"], 0) == wave]
            done = await asyncio.gather(*(self.kube.ensure(manifests[i]) for i in picked), return_exceptions=True)
            for i, result in zip(picked, done):
                results[i] = result
            if any(isinstance(r, BaseException) for r in done):
                break
        return results

    async def status(self, body: Mapping[str, Any], updates: list[dict], phase: str, **fields: Any) -> None:
        """Merge ``updates`` into the conditions and write the status, unless nothing changed (so a
        converged reconcile makes reads only)."""
        generation = body["metadata"].get("generation")
        previous = (body.get("status") or {}).get("conditions") or []
        merged = cond.merge_conditions(previous, updates, generation=generation, now=self.now())
        status = {"phase": phase, "observedGeneration": generation, "conditions": merged, **fields}
        current = body.get("status") or {}
        if all(current.get(k) == v for k, v in status.items()):
            return
        await self.kube.patch_status(m.API_VERSION, body["kind"], body["metadata"]["name"], status)

    async def delete_owned(self, body: Mapping[str, Any], api_version: str, kind: str, name: str,
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
