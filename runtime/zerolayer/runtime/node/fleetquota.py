"""Fleet-wide quota claims: each runtime's share of a tenant's limits, kept in ``TenantQuota.status``.

The runtime's half of :mod:`zerolayer.runtime.scheduler.fleet`. One thread per runtime:

- watches TenantQuotas (:class:`zerolayer.kubewatch.WatchLoop`) to see every node's claim;
- every ``period_s`` while this node holds or wants a claim (at once when the scheduler refuses
  for want of one) plans each tenant's claim from this node's demand (:func:`plan_claim`, pure);
- **raises** a claim only with a merge patch of ``status.fleetQuota.nodes.<node>`` that carries the
  object's ``metadata.resourceVersion`` as a precondition, computed from that very version: the API
  server refuses it (409) if any other node wrote in between, and the plan is made again from a
  fresh read. So the claims in the object never sum above the limit;
- **lowers** a claim in the scheduler first and publishes afterwards (a failed publish leaves the
  object holding more than is used, never less);
- renews a held claim every ``renew_s``; a claim not renewed for ``lease_s`` is not counted by the
  other nodes (a runtime that died), and the node itself stops admitting under it after
  ``lease_s - window_s - skew_s`` without renewal, so its last reservations have left the window
  before anyone else may take its share (clock skew between nodes up to ``skew_s``);
- on start, restores its own published claims as reserved (:meth:`FleetQuotaScheduler.restore`):
  a restarted runtime does not get a fresh window.

Status entry (per node): ``tokens``, ``requests`` (the claim), ``wantTokens``, ``wantRequests``
(demand, for proportional sharing when the fleet is short) and ``renewedAt`` (RFC 3339).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping

from zerolayer.gpumap import parse_rfc3339, utc_now_rfc3339
from zerolayer.runtime.scheduler.fleet import Claim, Demand, FleetQuotaScheduler

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "zerolayer.io", "v1alpha1", "tenantquotas"


class ClaimConflict(RuntimeError):
    """The TenantQuota changed since it was read (HTTP 409): plan again from a fresh read."""


@dataclasses.dataclass(frozen=True)
class FleetQuotaSettings:
    period_s: float = 0.5  # planning rounds while a claim is held or wanted
    headroom: float = 0.10  # share of the limit a busy node asks for beyond its demand
    idle_s: float = 10.0  # a claim is given back this long after the tenant's last use or refusal here
    lease_s: float = 180.0
    renew_s: float = 30.0
    skew_s: float = 30.0  # tolerated clock skew between nodes (renewedAt is wall time)
    window_s: float = 60.0
    max_attempts: int = 3

    @property
    def validity_s(self) -> float:
        """How long after a successful write this node may admit under the claim it wrote."""
        return max(0.0, self.lease_s - self.window_s - self.skew_s)


@dataclasses.dataclass(frozen=True)
class NodeClaim:
    tokens: int = 0
    requests: int = 0
    want_tokens: int = 0
    want_requests: int = 0
    renewed_at: float | None = None  # Unix seconds


# --------------------------------------------------------------------------- pure
def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def node_claims(quota: Mapping[str, Any]) -> dict[str, NodeClaim]:
    """Every node's published claim on this TenantQuota."""
    nodes = (((quota.get("status") or {}).get("fleetQuota") or {}).get("nodes")) or {}
    out = {}
    for node, entry in nodes.items() if isinstance(nodes, Mapping) else ():
        if isinstance(entry, Mapping):
            out[str(node)] = NodeClaim(_int(entry.get("tokens")), _int(entry.get("requests")),
                                       _int(entry.get("wantTokens")), _int(entry.get("wantRequests")),
                                       parse_rfc3339(entry.get("renewedAt")))
    return out


def live_others(claims: Mapping[str, NodeClaim], node: str, now_wall: float, lease_s: float) -> list[NodeClaim]:
    """Other nodes' claims whose lease holds (renewed within ``lease_s``)."""
    return [c for n, c in claims.items() if n != node and c.renewed_at is not None
            and now_wall - c.renewed_at <= lease_s]


def plan_dimension(limit: int | None, own: int, used: int, refused: int, largest: int,
                   others_claimed: int, others_want: int, headroom: float, recent: bool = False) -> tuple[int, int]:
    """(new claim, want) for one limit (tokens or requests) of one tenant on this node.

    Want: what is reserved in the window, plus what was refused since the last round, plus a
    headroom (``headroom`` of the limit, at least the largest request) while the tenant is busy
    here (something reserved or refused now, or ``recent``ly); 0 when idle. When every node's want together exceeds the limit, the node aims at its
    proportional share. A claim never goes below ``used`` and is raised at most to what the
    other nodes leave free.
    """
    if limit is None:
        return 0, 0
    active = used > 0 or refused > 0 or recent
    quantum = max(1, math.ceil(limit * headroom / 2))  # want is published in these steps: fewer writes
    want = min(limit, math.ceil((used + refused + max(largest, math.ceil(limit * headroom))) / quantum) * quantum)
    if not active:
        return 0, 0  # idle here: give everything back (used is 0, so this is always safe)
    target = want
    if others_want + want > limit and want > 0:  # the fleet is short: proportional to want
        target = min(want, math.floor(limit * want / (others_want + want)))
    target = max(target, used)
    free = max(0, limit - others_claimed)
    contended = others_want + want > limit
    step = max(1, quantum // 2 if contended else quantum)  # hysteresis: fewer writes
    if target > own and (refused > 0 or target - own >= step):
        return max(own, min(target, free)), want
    if own + others_claimed > limit:  # the limit was lowered under the claims: give back at once
        return max(used, min(target, own, free)), want
    if target < own and own - target >= step:
        return target, want
    return own, want


def plan_claim(quota: Mapping[str, Any], node: str, demand: Demand, now_wall: float,
               settings: FleetQuotaSettings, recent: bool = False) -> NodeClaim:
    """This node's next claim on ``quota`` (pure; the caller writes it if it differs). ``recent``:
    the tenant was busy here within ``settings.idle_s`` (a refused client comes back)."""
    spec = quota.get("spec") or {}
    claims = node_claims(quota)
    own = claims.get(node, NodeClaim())
    if own.renewed_at is None or now_wall - own.renewed_at > settings.lease_s:
        own = NodeClaim()  # lapsed: the others no longer count it, and neither do we
    others = live_others(claims, node, now_wall, settings.lease_s)
    tokens, want_t = plan_dimension(spec.get("tokensPerMinute"), own.tokens, demand.used_tokens,
                                    demand.refused_tokens, demand.largest_request,
                                    sum(c.tokens for c in others), sum(c.want_tokens for c in others),
                                    settings.headroom, recent)
    requests, want_r = plan_dimension(spec.get("requestsPerMinute"), own.requests, demand.used_requests,
                                      demand.refused_requests, 1, sum(c.requests for c in others),
                                      sum(c.want_requests for c in others), settings.headroom, recent)
    return NodeClaim(tokens, requests, want_t, want_r, own.renewed_at)


def claim_patch(quota: Mapping[str, Any], node: str, claim: NodeClaim, now_wall: float) -> dict[str, Any]:
    """The merge patch that sets this node's entry, conditional on ``quota``'s resourceVersion."""
    entry = {"tokens": claim.tokens, "requests": claim.requests, "wantTokens": claim.want_tokens,
             "wantRequests": claim.want_requests, "renewedAt": utc_now_rfc3339(now_wall)}
    patch: dict[str, Any] = {"status": {"fleetQuota": {"nodes": {node: entry}}}}
    version = (quota.get("metadata") or {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


def room_left(quota: Mapping[str, Any], node: str, mine: NodeClaim, now_wall: float, lease_s: float) -> bool:
    """Whether the fleet leaves any of the tenant's limits unclaimed."""
    spec = quota.get("spec") or {}
    others = live_others(node_claims(quota), node, now_wall, lease_s)
    for limit, field in (("tokensPerMinute", "tokens"), ("requestsPerMinute", "requests")):
        if spec.get(limit) is not None and spec[limit] - sum(getattr(c, field) for c in others) \
                - getattr(mine, field) <= 0:
            return False
    return True


# --------------------------------------------------------------------------- API
class ClaimApi:
    """The calls the claim thread makes (one ``CustomObjectsApi``); tests substitute this class."""

    def __init__(self, custom: Any) -> None:
        self._custom = custom

    def watch(self, on_change: Callable[[], None], *, retry_s: float = 2.0) -> Any:
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._custom.list_cluster_custom_object, GROUP, VERSION, PLURAL,
                         name="tenantquota-claims", on_change=on_change, retry_s=retry_s)

    def get(self, name: str) -> dict[str, Any]:
        return dict(self._custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name, _request_timeout=10))

    def patch_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return dict(self._custom.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, dict(patch),
                                                                        _request_timeout=10))
        except Exception as exc:
            if getattr(exc, "status", None) == 409:
                raise ClaimConflict(f"TenantQuota {name} changed while a claim was written") from exc
            raise


# --------------------------------------------------------------------------- the thread
class FleetQuotaSync:
    """Keeps this node's claims (see the module docstring) for ``scheduler``.

    ``wall``/``clock`` are Unix and monotonic time (tests move them). ``writes``, ``conflicts``
    and ``errors`` count what it did.
    """

    def __init__(self, api: Any, scheduler: FleetQuotaScheduler, node: str, *,
                 settings: FleetQuotaSettings | None = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.scheduler = scheduler
        self.node = node
        self.settings = settings or FleetQuotaSettings(window_s=scheduler.window_s)
        self.wall = wall
        self.clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written: dict[str, float] = {}  # tenant -> wall time of our last successful write
        self._busy: dict[str, float] = {}  # tenant -> monotonic time it last reserved or was refused here
        self._after: dict[str, tuple[Any, dict[str, Any]]] = {}  # tenant -> (version we wrote on, object written)
        self._restored = False
        self.writes = 0
        self.conflicts = 0
        self.errors = 0
        scheduler.wake = self._wake.set
        self.watch = api.watch(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="fleet-quota", daemon=True)

    def start(self) -> "FleetQuotaSync":
        self.watch.start()
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self.watch.stop(timeout)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _by_tenant(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for obj in sorted(self.watch.objects.values(),
                          key=lambda o: str((o.get("metadata") or {}).get("creationTimestamp") or "")):
            tenant = (obj.get("spec") or {}).get("tenant")
            if tenant and tenant not in out:
                out[str(tenant)] = obj
        return out

    def restore(self, quotas: Mapping[str, Mapping[str, Any]]) -> None:
        """Adopt this node's published, unexpired claims and count them as reserved now."""
        now, wall = self.clock(), self.wall()
        for tenant, quota in quotas.items():
            own = node_claims(quota).get(self.node)
            if own is None or own.renewed_at is None or wall - own.renewed_at > self.settings.lease_s:
                continue
            if own.tokens or own.requests:
                self.scheduler.restore(tenant, own.tokens, own.requests, now)
                left = self.settings.validity_s - max(0.0, wall - own.renewed_at)
                self.scheduler.set_claim(tenant, Claim(own.tokens, own.requests, now + left))
                log.info("fleet quota: restored this node's claim on %s (%d tokens, %d requests) as used",
                         tenant, own.tokens, own.requests)

    def round(self) -> bool:
        """One planning round over every tenant this node claims or wants. True if a claim is held."""
        quotas = self._by_tenant()
        if not self._restored:
            self.restore(quotas)
            self._restored = True
        holding = False
        for demand in self.scheduler.demand(self.clock()):
            quota = quotas.get(demand.tenant)
            if quota is None:
                continue
            before, written = self._after.get(demand.tenant, (None, None))
            if written is not None and (quota.get("metadata") or {}).get("resourceVersion") == before:
                quota = written  # the watch has not delivered our own last write yet: start from it
            try:
                holding |= self._step(demand, quota)
            except Exception as exc:  # noqa: BLE001 - one tenant's failure must not stop the others
                self.errors += 1
                log.warning("fleet quota: claim on %s not updated: %s", demand.tenant, exc)
        return holding

    def _step(self, demand: Demand, quota: Mapping[str, Any]) -> bool:
        s = self.settings
        name = quota["metadata"]["name"]
        for _ in range(s.max_attempts):
            wall = self.wall()
            current = node_claims(quota).get(self.node, NodeClaim())
            now = self.clock()
            if demand.used_tokens or demand.used_requests or demand.refused_tokens or demand.refused_requests:
                self._busy[demand.tenant] = now
            recent = now - self._busy.get(demand.tenant, -math.inf) < s.idle_s
            plan = plan_claim(quota, self.node, demand, wall, s, recent)
            held = self.scheduler.claim(demand.tenant)
            lowered = Claim(min(held.tokens, plan.tokens), min(held.requests, plan.requests), held.valid_until)
            self.scheduler.set_claim(demand.tenant, lowered, room=room_left(quota, self.node, plan, wall, s.lease_s))
            renew = (plan.tokens or plan.requests) and wall - self._written.get(demand.tenant, 0.0) >= s.renew_s
            same = (plan.tokens, plan.requests, plan.want_tokens, plan.want_requests) == (
                current.tokens, current.requests, current.want_tokens, current.want_requests)
            # This node's claim in the scheduler rises only after a successful conditional write: the object
            # read may be stale (the watch lags our own writes), so "already published" proves nothing.
            raise_local = plan.tokens > lowered.tokens or plan.requests > lowered.requests
            if same and not renew and not raise_local and self._written.get(demand.tenant) is not None:
                return bool(plan.tokens or plan.requests)
            if same and not (plan.tokens or plan.requests) and not current.renewed_at:
                return False  # nothing claimed, nothing published: no write
            try:
                written = self.api.patch_status(name, claim_patch(quota, self.node, plan, wall))
            except ClaimConflict:
                self.conflicts += 1
                quota = self.api.get(name)
                continue
            self.writes += 1
            self._written[demand.tenant] = wall
            if isinstance(written, Mapping) and written.get("metadata"):
                self._after[demand.tenant] = ((quota.get("metadata") or {}).get("resourceVersion"), dict(written))
            self.scheduler.set_claim(demand.tenant, Claim(plan.tokens, plan.requests,
                                                          self.clock() + s.validity_s),
                                     room=room_left(written or quota, self.node, plan, wall, s.lease_s))
            return bool(plan.tokens or plan.requests)
        log.info("fleet quota: claim on %s contended %d times in a row; next round", demand.tenant, s.max_attempts)
        return True

    def _run(self) -> None:
        while not self.watch.started.wait(0.5):
            if self._stop.is_set():
                return
        holding = True
        while not self._stop.is_set():
            self._wake.clear()
            try:
                holding = self.round()
            except Exception:  # noqa: BLE001 - a dead thread would freeze every claim
                self.errors += 1
                log.exception("fleet quota round failed")
            self._wake.wait(self.settings.period_s if holding else None)
            if not self._stop.is_set():
                self._stop.wait(min(0.05, self.settings.period_s))  # coalesce a burst of refusals
