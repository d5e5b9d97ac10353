"""Leader election with a ``coordination.k8s.io/v1`` Lease: of several operator replicas, one acts.

Why a Lease of our own and not kopf's peering: kopf pauses an operator when it sees a peer
of *higher* priority, and when it sees a peer of the *same* priority it pauses every one of
them ("Pausing all operators, including self"). Replicas of one Deployment all have the same
priority, so peering would give either two active operators (different priorities must be
handed out per pod, which a Deployment cannot do) or none. A Lease is what Kubernetes' own
controllers use (client-go's leaderelection), needs no CRD, and its rules are below.

The contract (the same as client-go's, with its clock-skew rule):

- The Lease ``name`` in ``namespace`` names its holder, the time it last renewed and how long
  that renewal is good for (``leaseDurationSeconds``). Every write is an update with the
  ``resourceVersion`` read just before, so of two candidates at most one succeeds.
- A candidate takes the Lease only when it is free (no holder) or when its record has not
  changed for a full ``duration`` *as measured on the candidate's own monotonic clock since it
  first saw that record* (timestamps written by another machine are never compared with ours).
- The holder renews every ``duration / 3``; if it has not renewed for ``duration * 2 / 3``
  (the renew deadline) it stops acting, which is before any candidate may take over, so two
  holders never act at once unless a process is paused for longer than ``duration / 3``
  between its last check and its next write (the limit every Lease-based election has).
- A holder that stops on purpose releases the Lease (no holder, duration 1 s), so a standby
  takes over at its next poll instead of after ``duration``.

Only :class:`~zerolayer.operator.kube.Kube` talks to the API server; this module decides.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any, Callable

from zerolayer.operator.errors import Conflict, KubeError, NotFound
from zerolayer.operator.kube import Kube, path_of

log = logging.getLogger(__name__)

LEASE = ("coordination.k8s.io/v1", "Lease")


def _micro_time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class LeaderElector:
    """Acquire, hold and release one Lease for ``identity``.

    ``duration``: seconds a holder's renewal is good for. ``clock`` (monotonic seconds),
    ``sleep`` and ``now`` (wall time written into the Lease) are injectable for tests.
    """

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, duration: float = 60.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = asyncio.sleep,
                 now: Callable[[], datetime.datetime] = _utcnow):
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration = float(duration)
        self.clock, self.sleep, self.now = clock, sleep, now
        self._observed: tuple | None = None  # the other holder's record as last seen
        self._observed_at = 0.0  # when (our clock) that record was first seen
        self._renewed_at: float | None = None  # when (our clock) we last wrote our own renewal
        self._lease: dict | None = None  # the Lease as our last write left it
        self.transitions = 0

    @property
    def retry_every(self) -> float:
        """How often a holder renews and a candidate looks again."""
        return self.duration / 3

    @property
    def renew_deadline(self) -> float:
        """A holder that has not renewed for this long stops acting (before anyone may take over)."""
        return self.duration * 2 / 3

    def _path(self, name: str | None = None) -> str:
        return path_of(*LEASE, self.namespace, name)

    def _spec(self, acquire: bool, transitions: int) -> dict:
        now = _micro_time(self.now())
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.duration)),
                "renewTime": now, "leaseTransitions": transitions}
        if acquire:
            spec["acquireTime"] = now
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when we hold the Lease afterwards (taken or renewed), False when
        someone else holds it or won a race for it. API errors propagate as KubeError.

        A holder renews with one update of the Lease as it last wrote it (its resourceVersion
        proves nobody changed it since); only when that conflicts does it read the Lease."""
        mine = self._lease
        if mine is not None and (mine.get("spec") or {}).get("holderIdentity") == self.identity:
            renewed = {**mine, "spec": {**mine["spec"], **self._spec(acquire=False,
                                                                     transitions=int(mine["spec"].get("leaseTransitions") or 0))}}
            try:
                self._lease = await self.kube.request("PUT", self._path(self.name), body=renewed)
                self._renewed_at = self.clock()
                return True
            except Conflict:
                self._lease = None  # changed behind our back: read it and decide below
            except NotFound:
                self._lease = None
        try:
            lease = await self.kube.request("GET", self._path(self.name))
        except NotFound:
            body = {"apiVersion": LEASE[0], "kind": LEASE[1],
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(acquire=True, transitions=0)}
            try:
                self._lease = await self.kube.request("POST", self._path(), body=body)
            except Conflict:
                return False  # another candidate created it first
            self._renewed_at = self.clock()
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder != self.identity:
            record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"), transitions)
            if record != self._observed:
                self._observed, self._observed_at = record, self.clock()
            held_for = float(spec.get("leaseDurationSeconds") or self.duration)
            if holder and self.clock() - self._observed_at < held_for:
                return False  # held, and renewed within its duration as far as our clock can tell
            transitions += 1
        lease["spec"] = {**spec, **self._spec(acquire=holder != self.identity, transitions=transitions)}
        try:
            self._lease = await self.kube.request("PUT", self._path(self.name), body=lease)  # carries resourceVersion
        except Conflict:
            return False  # changed since we read it: someone else renewed or took it
        self._renewed_at = self.clock()
        if holder != self.identity:
            self.transitions = transitions
            log.info("took the Lease %s/%s (previous holder: %s)", self.namespace, self.name, holder or "none")
        return True

    async def acquire(self) -> None:
        """Wait until this candidate holds the Lease."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    log.info("leading: holding Lease %s/%s as %s", self.namespace, self.name, self.identity)
                    return
                log.info("standing by: Lease %s/%s is held by %s", self.namespace, self.name,
                         (self._observed or ("?",))[0])
            except KubeError as exc:
                log.warning("could not read or take Lease %s/%s: %s", self.namespace, self.name, exc)
            await self.sleep(self.retry_every)

    def holding(self) -> bool:
        """Whether our last renewal is recent enough to act on (within the renew deadline)."""
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline

    async def hold(self) -> None:
        """Renew every ``retry_every``; return as soon as leadership is lost: another holder
        took the Lease, or no renewal succeeded within the renew deadline."""
        while True:
            await self.sleep(self.retry_every)
            try:
                if not await self.try_acquire_or_renew():
                    log.error("lost Lease %s/%s to %s", self.namespace, self.name, (self._observed or ("?",))[0])
                    self._renewed_at = None
                    return
            except KubeError as exc:
                log.warning("could not renew Lease %s/%s: %s", self.namespace, self.name, exc)
            if not self.holding():
                log.error("no renewal of Lease %s/%s for %.0f s: stopping", self.namespace, self.name,
                          self.renew_deadline)
                return

    async def release(self) -> None:
        """Give the Lease up (no holder) so a standby takes over at once; best effort."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        self._lease = None
        try:
            lease = await self.kube.request("GET", self._path(self.name))
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1,
                             "renewTime": _micro_time(self.now())}
            await self.kube.request("PUT", self._path(self.name), body=lease)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except KubeError as exc:
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)
