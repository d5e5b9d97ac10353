"""The per-model endpoints' reconciler: read the facts through the kube layer, plan (:mod:`.model_plan`),
apply (create or patch the Services and pools, delete the ones no model needs).

One sync covers every model at once (models are few, and a model's Service depends on every
InferenceNode), coalesced: :meth:`ModelEndpoints.soon` after an InferenceNode is created, changes its
spec or is deleted, or a model Service is deleted or edited by hand. The InferenceNodes and Services
come from the operator's watch cache; the pools (only with ``inference_pools`` on) are listed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from zerolayer.operator import manifests as m
from zerolayer.operator import model_plan
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import KubeError, NotOwned
from zerolayer.operator.kube import Kube
from zerolayer.operator.plan import Plan

log = logging.getLogger(__name__)

COALESCE_SECONDS = 1.0
RETRY_SECONDS = 10.0


class ModelEndpoints:
    """Keeps one Service (and optionally one InferencePool) per served model in the runtime namespace."""

    def __init__(self, kube: Kube, config: OperatorConfig, selector: Mapping[str, str] | None = None) -> None:
        self.kube = kube
        self.config = config
        self.selector = dict(selector or {})  # this operator's InferenceNodes only (--selector)
        self._lock = asyncio.Lock()
        self._pending: asyncio.Task | None = None
        self._warned_no_crd = False

    def soon(self, delay: float = COALESCE_SECONDS) -> None:
        """Sync ``delay`` seconds from now; calls until then join that sync."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._later(delay), name="model endpoints")

    async def _later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._pending = None  # events from here on schedule the next sync
        try:
            await self.sync()
        except KubeError as exc:
            log.warning("model endpoints: %s; again in %.0f s", exc, RETRY_SECONDS)
            self.soon(RETRY_SECONDS)

    async def _pools(self) -> tuple[list[dict], bool]:
        """The existing model pools and whether pools are wanted (on, and the CRD installed)."""
        if not self.config.inference_pools:
            return [], False
        if not await self.kube.crd_exists(model_plan.POOL_CRD):
            if not self._warned_no_crd:
                log.warning("inference_pools is on but the CRD %s is not installed: no InferencePools",
                            model_plan.POOL_CRD)
                self._warned_no_crd = True
            return [], False
        pools = await self.kube.list(model_plan.POOL_API_VERSION, "InferencePool", self.config.runtime_namespace,
                                     label_selector=model_plan.MODEL_SERVICE_LABEL)
        return pools, True

    async def sync(self) -> Plan:
        """One sync: plan from the cached InferenceNodes and Services, then apply."""
        async with self._lock:
            inodes = [x for x in self.kube.seen_all(m.API_VERSION, "InferenceNode")
                      if all(((x.get("metadata") or {}).get("labels") or {}).get(k) == v
                             for k, v in self.selector.items())]
            services = [s for s in self.kube.seen_all("v1", "Service")
                        if model_plan.MODEL_SERVICE_LABEL in ((s.get("metadata") or {}).get("labels") or {})
                        and s["metadata"].get("namespace") == self.config.runtime_namespace]
            pools, wanted = await self._pools()
            plan = model_plan.plan_model_endpoints(inodes, services, pools, self.config, pools_wanted=wanted)
            for child in plan.children:
                try:
                    result, _ = await self.kube.ensure(child)
                except NotOwned as exc:  # a Service of that name that another controller owns
                    log.warning("model endpoints: %s", exc)
                    continue
                if result != "unchanged":
                    log.info("model endpoints: %s %s %s", result, child["kind"], child["metadata"]["name"])
            for removal in plan.removals:
                if await self.kube.delete(removal.api_version, removal.kind, removal.name, removal.namespace):
                    log.info("model endpoints: deleted %s %s: %s", removal.kind, removal.name, removal.message)
            for note in plan.notes:
                log.warning("model endpoints: %s", note.message)
            return plan

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
