"""The micro-scheduler: the ``Scheduler`` protocol built from the plugins in ``plugins.py``.

It does no I/O and never blocks beyond a short internal lock (taken so that a telemetry
thread may call ``observe`` while the event loop admits). All times are the caller's
monotonic seconds (``time.monotonic()``), the same clock as ``Pressure.sampled_at``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Mapping, Sequence

from prometheus_client import CollectorRegistry

from zerolayer.contract import ErrorCode, Priority

from .api import Admission, Preemption, Pressure, Reservation, RunningStream, TenantPolicy, Ticket
from .running import LocalRunning, RunningView
from .config import SchedulerConfig, SchedulerError
from .metrics import SchedulerMetrics
from .plugins import (AdmissionContext, Filter, OrderingPolicy, QuotaFilter, Refusal, SharedState, VictimPicker,
                      build_filters, build_ordering, build_victim_picker)
from .pressure import SHED_CLASSES, PressureGate, Projection
from .quota import QuotaLedger, retry_after_header

STAGES = ("headers", "body")


@dataclasses.dataclass
class _Stream:
    ticket: Ticket
    reservation: Reservation


def _plugins(state: SharedState, config: SchedulerConfig
             ) -> tuple[list[Filter], QuotaFilter | None, OrderingPolicy, VictimPicker]:
    """The plugins ``config`` names, reading ``state``: the filter chain, its quota filter when it has one
    (decided again under a node-wide ledger's lock, :meth:`MicroScheduler._charge`), ordering, victim picker."""
    filters = build_filters(state, config.filters)
    quota = next((f for f in filters if isinstance(f, QuotaFilter)), None)
    return filters, quota, build_ordering(state, config.ordering), build_victim_picker(state, config.victims)


class MicroScheduler:
    """Admission, ordering, quotas, deadlines and shedding for one engine process.

    Contract (beyond :class:`~zerolayer.runtime.scheduler.api.Scheduler`):

    * ``admit(..., stage="body")`` for a stream admitted at HEADERS re-sizes its reservation
      with the exact prompt size; it is not counted again as a request or an open stream.
      If it refuses, the HEADERS reservation is released at once.
    * ``settle`` is keyed by ``stream_key`` and idempotent: settling a stream that was
      refused, already settled, or never admitted does nothing.
    * ``observe``/``expired`` return each stream at most once until it is settled, so the
      server never resets the same stream twice, and only streams still open here (admitted,
      not settled): one that ended while the server was sampling is not returned.
    * Refusals carry ``retry-after`` both as ``retry_after_s`` and, ready to send, in
      ``headers`` (with ``x-ratelimit-*`` for quota refusals and, for the tenant's limits,
      on accepted admissions too).
    """

    def __init__(self, config: SchedulerConfig | None = None, *, registry: CollectorRegistry | None = None,
                 tenants: Mapping[str, TenantPolicy] | None = None, ledger: QuotaLedger | None = None,
                 running: RunningView | None = None) -> None:
        self.config = config or SchedulerConfig()
        # The node's running streams to shed from: one's own, or every API process's (running.py).
        self._running = running or LocalRunning()
        self.metrics = SchedulerMetrics(registry)
        if ledger is None:  # one process; several API processes share a node-wide one (board.py)
            ledger = QuotaLedger(self.config.quota_window_s, self.config.concurrency_retry_after_s)
        self._state = SharedState(self.config, PressureGate.from_config(self.config), ledger,
                                  Projection(self.config.kv_capacity_tokens))
        self._filters, self._quota, self._ordering, self._victims = _plugins(self._state, self.config)
        self._lock = threading.Lock()
        self._tenants: dict[str, TenantPolicy] = dict(tenants or {})
        self._streams: dict[str, _Stream] = {}
        self.metrics.open_streams.set_function(lambda: len(self._streams))  # read when scraped, not set per request
        self._preempted: set[str] = set()
        self._last_pressure: Pressure | None = None
        #: per class: sampled_at of the sample that started shedding, until the first refusal
        self._crossed_at: dict[Priority, float] = {}

    # ------------------------------------------------------------------ reading
    @property
    def registry(self) -> CollectorRegistry:
        """The prometheus registry holding every scheduler metric (mount it on /metrics)."""
        return self.metrics.registry

    @property
    def filter_names(self) -> list[str]:
        return [f.type_name for f in self._filters]

    def admitting(self, priority: Priority) -> bool:
        """Whether new streams of ``priority`` pass the pressure gate now (for the GPU map)."""
        with self._lock:
            return self._state.gate.admitting(priority)

    def engine_priority(self, ticket: Ticket) -> int:
        """The ``priority=`` to hand vLLM for this ticket (also in ``Admission.engine_priority``)."""
        return self._ordering.engine_priority(ticket)

    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Apply new settings to a running scheduler (an edited InferenceNode, no restart).

        Every setting takes effect at the next decision: shedding marks, preemption, the filters'
        settings (deadline estimate, retry-afters, unknown tenants), the plugin chain, ordering and
        victim picker (rebuilt when named differently), the quota window. A class that is shedding
        keeps shedding until a sample falls below its new resume mark. Open streams and quota
        reservations are untouched; a shorter window lets older charges go at the next check. A KV
        capacity adopted from the engine is kept when the new config leaves it at 0 and still allows
        adoption. An unknown plugin name raises :class:`SchedulerConfigError` and applies nothing.
        """
        with self._lock:
            if (config.kv_capacity_tokens == 0 and config.adopt_engine_kv_capacity
                    and self.config.adopt_engine_kv_capacity):
                config = dataclasses.replace(config, kv_capacity_tokens=self.config.kv_capacity_tokens)
            state = self._state
            named = (config.filters, config.ordering, config.victims)
            # built before anything changes: a bad name leaves everything as it was
            plugins = (_plugins(state, config) if named != (self.config.filters, self.config.ordering,
                                                            self.config.victims) else None)
            self.config = state.config = config
            if plugins is not None:
                self._filters, self._quota, self._ordering, self._victims = plugins
            state.gate.retune(config)
            state.projection.capacity_tokens = config.kv_capacity_tokens
            state.ledger.retune(config.quota_window_s, config.concurrency_retry_after_s)

    def adopt_kv_capacity(self, tokens: int) -> bool:
        """Project with the engine's KV-cache size (``tokens``) when the config left
        ``kv_capacity_tokens`` unset (0) and ``adopt_engine_kv_capacity`` on; a configured size
        wins. True if adopted."""
        if tokens <= 0 or self.config.kv_capacity_tokens > 0 or not self.config.adopt_engine_kv_capacity:
            return False
        with self._lock:
            self.config = self._state.config = dataclasses.replace(self.config, kv_capacity_tokens=tokens)
            self._state.projection.capacity_tokens = tokens
        return True

    # ------------------------------------------------------------------ protocol
    def set_tenants(self, policies: Mapping[str, TenantPolicy]) -> None:
        """Replace the tenant policies; open streams and their charges are kept."""
        with self._lock:
            self._tenants = dict(policies)

    def admit(self, ticket: Ticket, now: float, stage: str = "headers") -> Admission:
        if stage not in STAGES:
            raise SchedulerError(f"unknown admission stage {stage!r}; use one of {STAGES}")
        with self._lock:
            previous = self._streams.get(ticket.stream_key)
            policy = self._tenants.get(ticket.tenant)
            ctx = AdmissionContext(ticket, now, stage, policy, previous is not None, self._last_pressure)
            refusal = self._first_refusal(ctx)
            at = 0.0
            if refusal is None:
                # Everything that can fail comes before the first mutation: a plugin error must leave
                # no charge and no open stream behind.
                engine_priority = self._ordering.engine_priority(ticket)
                refusal, at = self._charge(ctx)
            if refusal is not None:
                if previous is not None:
                    self._release(previous, now)
                return self._refuse(ticket, refusal, now)
            reservation = Reservation(ticket.stream_key, ticket.tenant, ticket.priority,
                                      ticket.prompt_tokens + ticket.max_tokens, at)
            before = previous.reservation.reserved_tokens if previous is not None else 0
            self._state.projection.admitted(reservation.reserved_tokens - before, now)
            self._streams[ticket.stream_key] = _Stream(ticket, reservation)
            self.metrics.count_admitted(ticket.priority, stage)
            # The response carries the body stage's x-ratelimit-* headers; an accepted HEADERS stage's are
            # never answered (the response head waits for the body), so they are not built.
            headers = self._state.ledger.headers(policy, now) if policy is not None and stage == "body" else {}
            return Admission(True, reservation, headers=headers, engine_priority=engine_priority)

    def settle(self, reservation: Reservation, used_tokens: int, now: float) -> None:
        # No ledger transaction: a settle only lowers what the ledger publishes (_charge says why that is safe).
        with self._lock:
            stream = self._streams.get(reservation.stream_key)
            self._preempted.discard(reservation.stream_key)
            if stream is None:
                return
            del self._streams[reservation.stream_key]
            self._state.ledger.tenant(stream.ticket.tenant).settle(reservation.stream_key, used_tokens, now)

    def observe(self, pressure: Pressure, now: float) -> Sequence[Preemption]:
        with self._lock:
            self._state.ledger.refresh(now)
            self._last_pressure = pressure
            self._state.projection.sampled(pressure.sampled_at)
            self.metrics.memory_fraction.set(pressure.memory_fraction)
            for change in self._state.gate.update(pressure.memory_fraction, pressure.sampled_at):
                self.metrics.gate_changed(change.priority, change.shedding, now - change.sampled_at)
                if change.shedding:
                    self._crossed_at[change.priority] = change.sampled_at
                else:
                    self._crossed_at.pop(change.priority, None)
            live = {s.stream_key for s in pressure.running}
            self._preempted &= live | set(self._streams)
            return self._shed_running(pressure.running)

    def expired(self, running: Sequence[RunningStream], now: float) -> Sequence[Preemption]:
        out = []
        with self._lock:
            for stream in running:
                if stream.deadline is None or now < stream.deadline or stream.stream_key in self._preempted:
                    continue
                if stream.stream_key not in self._streams:
                    continue  # settled since the server's snapshot: nothing left to stop
                self._preempted.add(stream.stream_key)
                self.metrics.count_preempted("deadline", stream.priority, ErrorCode.DEADLINE_EXCEEDED.value)
                out.append(Preemption(stream.stream_key, ErrorCode.DEADLINE_EXCEEDED, "deadline"))
        return out

    # ------------------------------------------------------------------ internals
    def _charge(self, ctx: AdmissionContext) -> tuple[Refusal | None, float]:
        """Charge the ticket's reservation to its tenant: (None, charge time), or the quota's refusal.

        Under the ledger's transaction, which with several API processes is the node-wide lock of their
        shared board (``board.py``). There the quota filter's verdict in the chain was a first look, from
        rows the other processes may have raised since: the quota is decided again under the lock, from
        check to charge. That keeps the bound (a tenant's node-wide totals never pass its limits) while the
        rest of an admission (the other filters, metrics, headers) runs outside the lock: only a charge
        raises what a process publishes; settles, releases and the window's expiry only lower it, and each
        process's row has one writer, so those publish without the lock (a reader sees the old, higher
        value or the new one). In one process the transaction holds nothing and the check is not repeated.
        """
        ticket, ledger = ctx.ticket, self._state.ledger
        with ledger.transaction():
            if ledger.node_wide and self._quota is not None:
                refusal = self._quota.check(ctx)
                if refusal is not None:
                    return refusal, 0.0
            return None, ledger.tenant(ticket.tenant).charge(
                ticket.stream_key, ticket.prompt_tokens + ticket.max_tokens, ctx.now, new_request=not ctx.readmission)

    def _first_refusal(self, ctx: AdmissionContext) -> Refusal | None:
        for f in self._filters:
            refusal = f.check(ctx)
            if refusal is not None:
                return refusal
        return None

    def _refuse(self, ticket: Ticket, refusal: Refusal, now: float) -> Admission:
        self.metrics.count_refused(refusal.reason, ticket.priority, refusal.code.value)
        if refusal.code is ErrorCode.RATE_LIMITED:  # the tenant's quota is spent: which tenant, for its alert
            self.metrics.count_quota_refused(ticket.tenant, refusal.reason)
        if refusal.code is ErrorCode.RESOURCE_EXHAUSTED:
            crossed = self._crossed_at.pop(ticket.priority, None)
            if crossed is not None:
                self.metrics.reacted(ticket.priority, now - crossed)
        headers = dict(refusal.headers)
        if refusal.retry_after_s is not None:
            headers["retry-after"] = retry_after_header(refusal.retry_after_s)
            headers["retry-after-ms"] = str(max(0, round(refusal.retry_after_s * 1000)))
        return Admission(False, code=refusal.code, reason=refusal.reason, message=refusal.message,
                         retry_after_s=refusal.retry_after_s, headers=headers)

    def _release(self, stream: _Stream, now: float) -> None:
        del self._streams[stream.ticket.stream_key]
        self._state.ledger.tenant(stream.ticket.tenant).release(stream.ticket.stream_key, now)

    def _shed_running(self, running: Sequence[RunningStream]) -> list[Preemption]:
        # streams settled since the server took its snapshot, or already preempted, are no longer candidates
        own = [s for s in running if s.priority in SHED_CLASSES and s.stream_key in self._streams
               and s.stream_key not in self._preempted]
        out: list[Preemption] = []
        for victim in self._running.victims(own, self._pick):  # with several API processes: picked node-wide
            self._preempted.add(victim.stream_key)
            # GPU_OOM, not RESOURCE_EXHAUSTED: this stream already holds KV memory that ran out under it;
            # the contract's client policy (retry at once with max_tokens halved) asks for less of it.
            # A refusal at admission, before any memory was held, stays RESOURCE_EXHAUSTED.
            self.metrics.count_preempted("memory_pressure", victim.priority, ErrorCode.GPU_OOM.value)
            out.append(Preemption(victim.stream_key, ErrorCode.GPU_OOM, "memory_pressure"))
        return out

    def _pick(self, candidates: Sequence[RunningStream]) -> list[RunningStream]:
        """The victims of one sample among ``candidates``: lowest class first, within the budget."""
        budget = self.config.max_preemptions_per_tick
        chosen: list[RunningStream] = []
        for priority in SHED_CLASSES:  # lowest first: normal is touched only with budget left
            if budget <= 0:
                break
            if self._state.gate.sustained(priority) < self.config.preempt_after_samples:
                continue
            picked = self._victims.pick(candidates, priority, budget, frozenset())
            chosen.extend(picked)
            budget -= len(picked)
        return chosen
