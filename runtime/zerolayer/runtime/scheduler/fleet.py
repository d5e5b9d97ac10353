"""Fleet-wide quotas: a node admits a tenant's work only within the *claim* it holds on the tenant's limit.

Without this, every runtime enforces a tenant's ``tokens_per_minute`` on its own, so N nodes give
the tenant N times its quota. Here each node holds a claim (tokens, requests) per tenant, and

    **Invariant.** The claims of all nodes on a tenant sum to at most the tenant's limit
    (``runtime/node/fleetquota.py`` raises a claim only with a write conditional on the
    TenantQuota's resourceVersion that re-checks the sum; it lowers a claim locally first and
    publishes afterwards), and a node's claim never drops below what it has reserved in the
    trailing window.

    **Credit.** So that an idle node admits a tenant's first request at once, a node may reserve
    up to a small *credit* in the trailing window without a claim: ``ceil(credit_share x limit)``
    (5 %) of each limit, and at least ``credit_requests`` (1) request (so that a few requests arriving
    together on an idle node, before its claim is written, are all admitted). Its allowance is the larger of its
    claim and the credit, per limit; admitting beyond the claim wakes the sync thread, which then
    claims what was used. No credit while the claim has expired or the fleet had no unclaimed
    room at the last sync (a busy fleet's nodes hold claims, and the credit is not needed there).

    **Bound.** For every interval of ``window_s`` seconds, the tokens reserved by admissions of
    the tenant on all nodes together are <= ``tokens_per_minute + n x credit tokens`` and the
    admissions are <= ``requests_per_minute + n x credit requests``, where ``n`` is the number of
    nodes that admitted the tenant beyond their claim (under the credit) in that interval, at most
    the number of runtimes. (Each node keeps its own window's reservations within max(claim,
    credit) <= claim + credit at every moment, and the claims sum to at most the limit.) The
    other excess is the node-local one (``quota.py``): a settle that reports more than reserved.

:class:`FleetQuotaScheduler` wraps any :class:`~zerolayer.runtime.scheduler.api.Scheduler` (the
micro-scheduler) and keeps its contract: the fleet check runs first, the inner scheduler then
applies the tenant's own policy, concurrency and pressure as before. It does no I/O: claims are
set by the sync thread (:meth:`set_claim`), which reads demand back (:meth:`demand`). A tenant
beyond its claim and its credit is refused with ``RATE_LIMITED`` and a short ``retry-after``
while more claim is requested (the SDK retries that on the same node). Tenants without token or
request limits are not touched.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Mapping, Sequence

from zerolayer.contract import ErrorCode

from .api import Admission, Preemption, Pressure, Reservation, RunningStream, Scheduler, TenantPolicy, Ticket
from .quota import (H_LIMIT_REQUESTS, H_LIMIT_TOKENS, H_REMAINING_REQUESTS, H_REMAINING_TOKENS, QuotaLedger,
                    retry_after_header)


@dataclasses.dataclass(frozen=True)
class Claim:
    """This node's share of one tenant's limits. ``valid_until`` (monotonic seconds) ends it for new
    admissions when it could not be renewed in time (its lease may be taken over by other nodes)."""

    tokens: int = 0
    requests: int = 0
    valid_until: float = float("inf")


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one tenant used and wanted on this node: reserved in the trailing window, and refused for
    want of claim since the last :meth:`FleetQuotaScheduler.demand` call."""

    tenant: str
    used_tokens: int
    used_requests: int
    refused_tokens: int
    refused_requests: int
    largest_request: int


class FleetQuotaScheduler:
    """A :class:`Scheduler` that enforces this node's claims, then delegates to ``inner``.

    Attributes it does not define (``registry``, ``reconfigure``, ``admitting``...) are the inner
    scheduler's. ``wake`` is called (under the lock, must not block) when a tenant was refused for
    want of claim, so the sync thread asks for more at once. ``claim_wait_s`` is the
    ``retry-after`` of such a refusal while the fleet has unclaimed room. ``credit_requests`` and
    ``credit_share`` size the credit (module docstring); 0 turns it off.
    """

    def __init__(self, inner: Scheduler, *, window_s: float = 60.0, wake: Callable[[], None] | None = None,
                 claim_wait_s: float = 1.0, credit_requests: int = 1, credit_share: float = 0.05) -> None:
        if credit_requests < 0 or not 0.0 <= credit_share <= 1.0:
            raise ValueError("credit_requests must be >= 0 and credit_share within 0..1")
        self.inner = inner
        self.window_s = window_s
        self.wake = wake
        self.claim_wait_s = claim_wait_s
        self.credit_requests = credit_requests
        self.credit_share = credit_share
        self._ledger = QuotaLedger(window_s)
        self._lock = threading.Lock()
        self._policies: dict[str, TenantPolicy] = {}
        self._claims: dict[str, Claim] = {}
        self._room: dict[str, bool] = {}  # tenant -> the fleet had unclaimed room at the last sync
        self._refused: dict[str, list[int]] = {}  # tenant -> [tokens, requests] refused since demand()
        self._largest: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ sync-thread side
    def set_claim(self, tenant: str, claim: Claim, *, room: bool = False) -> None:
        """This node now holds ``claim`` on ``tenant``; ``room``: the fleet has unclaimed room left."""
        with self._lock:
            self._claims[tenant] = claim
            self._room[tenant] = room

    def claim(self, tenant: str) -> Claim:
        with self._lock:
            return self._claims.get(tenant, Claim())

    def restore(self, tenant: str, tokens: int, requests: int, now: float) -> None:
        """Count ``tokens`` and ``requests`` as reserved now (a restarted runtime's published claim:
        what it may have used before it stopped). They leave the window ``window_s`` from now."""
        with self._lock:
            self._ledger.tenant(tenant).restore(tokens, requests, now)

    def demand(self, now: float) -> list[Demand]:
        """Every tenant with a claim, a reservation or a refusal; resets the refused counts."""
        with self._lock:
            names = set(self._claims) | set(self._refused) | self._ledger.tenants()
            out = []
            for name in sorted(names):
                ledger = self._ledger.tenant(name)
                refused = self._refused.pop(name, [0, 0])
                out.append(Demand(name, ledger.tokens_in_window(now), ledger.requests_in_window(now),
                                  refused[0], refused[1], self._largest.get(name, 0)))
            return out

    def limited(self) -> dict[str, TenantPolicy]:
        """The tenants whose token or request rate is limited (what the fleet shares out)."""
        with self._lock:
            return dict(self._policies)

    # ------------------------------------------------------------------ the Scheduler protocol
    def set_tenants(self, policies: Mapping[str, TenantPolicy]) -> None:
        with self._lock:
            self._policies = {name: p for name, p in policies.items()
                              if p.tokens_per_minute is not None or p.requests_per_minute is not None}
        self.inner.set_tenants(policies)

    def admit(self, ticket: Ticket, now: float, stage: str = "headers") -> Admission:
        with self._lock:
            policy = self._policies.get(ticket.tenant)
            if policy is None:
                return self.inner.admit(ticket, now, stage)
            ledger = self._ledger.tenant(ticket.tenant)
            readmission = ticket.stream_key in ledger.open_streams
            refusal = self._check(policy, ticket, now, readmission)
            if refusal is not None:
                if readmission:  # the contract: a body-stage refusal releases the HEADERS reservation
                    ledger.release(ticket.stream_key, now)
                    self.inner.settle(Reservation(ticket.stream_key, ticket.tenant, ticket.priority, 0, now), 0, now)
                return refusal
            admission = self.inner.admit(ticket, now, stage)
            if admission.admitted and admission.reservation is not None:
                ledger.charge(ticket.stream_key, admission.reservation.reserved_tokens, now,
                              new_request=not readmission)
                self._largest[ticket.tenant] = max(self._largest.get(ticket.tenant, 0),
                                                   admission.reservation.reserved_tokens)
                if self._beyond_claim(policy, ticket.tenant, now) and self.wake is not None:
                    self.wake()  # admitted under the credit: claim what was used now
            elif readmission:
                ledger.release(ticket.stream_key, now)
            return admission

    def settle(self, reservation: Reservation, used_tokens: int, now: float) -> None:
        with self._lock:
            if reservation.tenant in self._ledger.tenants():
                self._ledger.tenant(reservation.tenant).settle(reservation.stream_key, used_tokens, now)
        self.inner.settle(reservation, used_tokens, now)

    def observe(self, pressure: Pressure, now: float) -> Sequence[Preemption]:
        return self.inner.observe(pressure, now)

    def expired(self, running: Sequence[RunningStream], now: float) -> Sequence[Preemption]:
        return self.inner.expired(running, now)

    # ------------------------------------------------------------------ internals
    def _allowance(self, policy: TenantPolicy, tenant: str, now: float) -> tuple[int, int, bool]:
        """(tokens, requests) this node may hold reserved in the window now, and whether the claim
        expired: the larger of the claim and the credit, or the claim alone (see the docstring)."""
        claim = self._claims.get(tenant, Claim())
        expired = now >= claim.valid_until
        if expired or not self._room.get(tenant, True):
            return claim.tokens, claim.requests, expired
        credit_tokens, credit_requests = self.credit(policy)
        return max(claim.tokens, credit_tokens), max(claim.requests, credit_requests), False

    def credit(self, policy: TenantPolicy) -> tuple[int, int]:
        """(tokens, requests) of the credit for ``policy``: ``credit_share`` of each limit, and at
        least ``credit_requests`` requests (none at all when ``credit_requests`` is 0)."""
        if not self.credit_requests:
            return 0, 0
        return (math.ceil((policy.tokens_per_minute or 0) * self.credit_share),
                max(self.credit_requests, math.ceil((policy.requests_per_minute or 0) * self.credit_share)))

    def _beyond_claim(self, policy: TenantPolicy, tenant: str, now: float) -> bool:
        claim, ledger = self._claims.get(tenant, Claim()), self._ledger.tenant(tenant)
        return (policy.requests_per_minute is not None and ledger.requests_in_window(now) > claim.requests) or (
            policy.tokens_per_minute is not None and ledger.tokens_in_window(now) > claim.tokens)

    def _check(self, policy: TenantPolicy, ticket: Ticket, now: float, readmission: bool) -> Admission | None:
        tokens = ticket.prompt_tokens + ticket.max_tokens
        if policy.tokens_per_minute is not None and tokens > policy.tokens_per_minute:
            return None  # larger than the whole limit: the inner quota filter says request_too_large
        claim = self._claims.get(ticket.tenant, Claim())
        ledger = self._ledger.tenant(ticket.tenant)
        need = tokens - ledger.charged(ticket.stream_key)
        may_tokens, may_requests, expired = self._allowance(policy, ticket.tenant, now)
        short = None
        if not readmission and policy.requests_per_minute is not None and (
                expired or ledger.requests_in_window(now) + 1 > may_requests):
            short, retry = "requests", ledger.requests_retry_after(max(may_requests, 1), now)
        elif policy.tokens_per_minute is not None and (expired or ledger.tokens_in_window(now) + need > may_tokens):
            short, retry = "tokens", ledger.tokens_retry_after(need, max(may_tokens, need), now)
        if short is None:
            return None
        refused = self._refused.setdefault(ticket.tenant, [0, 0])
        refused[0] += max(0, need)
        refused[1] += 0 if readmission else 1
        self._largest[ticket.tenant] = max(self._largest.get(ticket.tenant, 0), tokens)
        if self.wake is not None:
            self.wake()
        if self._room.get(ticket.tenant, True) or retry <= 0:
            retry = self.claim_wait_s  # a claim is being asked for: come back soon
        headers = {"retry-after": retry_after_header(retry), "retry-after-ms": str(max(0, round(retry * 1000)))}
        if policy.requests_per_minute is not None:
            headers[H_LIMIT_REQUESTS] = str(policy.requests_per_minute)
            headers[H_REMAINING_REQUESTS] = str(max(0, claim.requests - ledger.requests_in_window(now)))
        if policy.tokens_per_minute is not None:
            headers[H_LIMIT_TOKENS] = str(policy.tokens_per_minute)
            headers[H_REMAINING_TOKENS] = str(max(0, claim.tokens - ledger.tokens_in_window(now)))
        limit = policy.tokens_per_minute if short == "tokens" else policy.requests_per_minute
        return Admission(False, code=ErrorCode.RATE_LIMITED, reason=f"fleet_{short}",
                         message=f"tenant {ticket.tenant!r} reached this node's share of its {limit} {short} per "
                                 f"minute across the fleet", retry_after_s=retry, headers=headers)
