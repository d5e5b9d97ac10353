"""Scheduler plugins: admission filters, the ordering policy and the victim picker.

Shaped like the Gateway API Inference Extension's scheduler: each plugin is small, has a
``type_name`` and a factory registered under it, and is table-tested on its own.

* A **filter** looks at one :class:`AdmissionContext` and returns ``None`` (pass) or a
  :class:`Refusal`. Filters never change state: the scheduler commits a reservation only
  after every filter passed, so a later refusal never leaves a half-made charge behind.
* An **ordering policy** turns an admitted ticket into the integer vLLM's
  ``scheduling_policy="priority"`` sorts by (lower first; ties first-come-first-served).
* A **victim picker** chooses which running streams to preempt under memory pressure.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

from zerolayer.contract import ErrorCode, Priority

from .api import Pressure, RunningStream, TenantPolicy, Ticket
from .config import SchedulerConfig, SchedulerConfigError
from .pressure import PressureGate, Projection
from .quota import QuotaLedger


@dataclasses.dataclass(slots=True)  # slotted, not frozen: built per request (see engine.base.Delta)
class AdmissionContext:
    """Everything a filter may look at for one admission decision."""

    ticket: Ticket
    now: float
    stage: str  # "headers" | "body"
    policy: TenantPolicy | None  # None: tenant unknown to the scheduler
    readmission: bool  # True when re-sizing a stream already admitted at HEADERS
    load: Pressure | None  # the latest telemetry sample, None before the first one


@dataclasses.dataclass(frozen=True)
class Refusal:
    code: ErrorCode
    reason: str  # metrics label
    message: str
    retry_after_s: float | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SharedState:
    """State owned by the scheduler that stateful filters read (they never write it)."""

    config: SchedulerConfig
    gate: PressureGate
    ledger: QuotaLedger
    projection: Projection = dataclasses.field(default_factory=lambda: Projection(0))


class Filter(Protocol):
    type_name: str

    def check(self, ctx: AdmissionContext) -> Refusal | None: ...


class OrderingPolicy(Protocol):
    type_name: str

    def engine_priority(self, ticket: Ticket) -> int: ...


class VictimPicker(Protocol):
    type_name: str

    def pick(self, running: Sequence[RunningStream], priority: Priority, limit: int,
             exclude: set[str] | frozenset[str]) -> list[RunningStream]: ...


FilterFactory = Callable[[SharedState], Filter]
FILTERS: dict[str, FilterFactory] = {}
ORDERINGS: dict[str, Callable[[SharedState], OrderingPolicy]] = {}
VICTIM_PICKERS: dict[str, Callable[[SharedState], VictimPicker]] = {}


def _register(table: dict, type_name: str):
    def deco(cls):
        cls.type_name = type_name
        table[type_name] = cls
        return cls
    return deco


# Each builder takes the plugin names from ``state.config`` unless given (MicroScheduler.reconfigure
# builds a new config's plugins before applying it). Plugins read ``state.config`` when they decide,
# never keep a copy of it: reconfigure replaces it.
def build_filters(state: SharedState, names: Sequence[str] | None = None) -> list[Filter]:
    return [_lookup(FILTERS, "filter", name)(state) for name in (state.config.filters if names is None else names)]


def build_ordering(state: SharedState, name: str | None = None) -> OrderingPolicy:
    return _lookup(ORDERINGS, "ordering policy", name or state.config.ordering)(state)


def build_victim_picker(state: SharedState, name: str | None = None) -> VictimPicker:
    return _lookup(VICTIM_PICKERS, "victim picker", name or state.config.victims)(state)


def _lookup(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise SchedulerConfigError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}") from None


# ============================================================================ filters
@_register(FILTERS, "permission")
class PermissionFilter:
    """Allowed priorities and models of the tenant -> PERMISSION_DENIED."""

    def __init__(self, state: SharedState) -> None:
        self._state = state  # its config is read at each check: reconfigure() replaces it

    def check(self, ctx: AdmissionContext) -> Refusal | None:
        policy, ticket = ctx.policy, ctx.ticket
        if policy is None:
            if self._state.config.unknown_tenants_allowed:
                return None
            return Refusal(ErrorCode.PERMISSION_DENIED, "unknown_tenant",
                           f"tenant {ticket.tenant!r} has no quota on this node")
        if ticket.priority not in policy.allowed_priorities:
            allowed = ", ".join(p.name.lower() for p in sorted(policy.allowed_priorities)) or "none"
            return Refusal(ErrorCode.PERMISSION_DENIED, "priority_not_allowed",
                           f"tenant {ticket.tenant!r} may not use priority {ticket.priority.name.lower()} "
                           f"(allowed: {allowed})")
        if policy.allowed_models is not None and ticket.model not in policy.allowed_models:
            return Refusal(ErrorCode.PERMISSION_DENIED, "model_not_allowed",
                           f"tenant {ticket.tenant!r} may not use model {ticket.model!r}")
        return None


@_register(FILTERS, "quota")
class QuotaFilter:
    """Tokens/min, requests/min and concurrent streams of the tenant -> 429 RATE_LIMITED."""

    def __init__(self, state: SharedState) -> None:
        self._ledger = state.ledger

    def check(self, ctx: AdmissionContext) -> Refusal | None:
        if ctx.policy is None:
            return None
        ticket = ctx.ticket
        verdict = self._ledger.check(ctx.policy, ticket.stream_key, ticket.prompt_tokens + ticket.max_tokens,
                                     ctx.now, new_request=not ctx.readmission)
        if verdict is None:
            return None
        return Refusal(ErrorCode.RATE_LIMITED, verdict.reason, verdict.message, verdict.retry_after_s,
                       self._ledger.headers(ctx.policy, ctx.now))


@_register(FILTERS, "deadline")
class DeadlineFilter:
    """Refuse work whose first token cannot arrive before its deadline -> DEADLINE_EXCEEDED.

    The estimate is deliberately optimistic (a floor, not a forecast): the scheduler refuses
    only what certainly fails, and ``expired()`` stops what turns out late.
    ``first_token_estimate = min_first_token_s + prompt_tokens / prefill_tokens_per_s
    + waiting * queue_delay_per_waiting_s``.
    """

    def __init__(self, state: SharedState) -> None:
        self._state = state  # its config is read at each check: reconfigure() replaces it

    def estimate_first_token_s(self, ticket: Ticket, load: Pressure | None) -> float:
        c = self._state.config
        waiting = load.waiting if load is not None else 0
        return c.min_first_token_s + ticket.prompt_tokens / c.prefill_tokens_per_s + waiting * c.queue_delay_per_waiting_s

    def check(self, ctx: AdmissionContext) -> Refusal | None:
        deadline = ctx.ticket.deadline
        if deadline is None:
            return None
        estimate = self.estimate_first_token_s(ctx.ticket, ctx.load)
        if ctx.now + estimate <= deadline:
            return None
        left_ms = (deadline - ctx.now) * 1000
        reason = "deadline_passed" if left_ms <= 0 else "deadline_unreachable"
        return Refusal(ErrorCode.DEADLINE_EXCEEDED, reason,
                       f"deadline leaves {left_ms:.1f} ms but the first token needs at least {estimate * 1000:.1f} ms")


@_register(FILTERS, "pressure")
class PressureFilter:
    """New streams of a class being shed are refused at once -> RESOURCE_EXHAUSTED."""

    def __init__(self, state: SharedState) -> None:
        self._state = state  # its config is read at each check: reconfigure() replaces it
        self._gate = state.gate
        self._projection = state.projection

    def check(self, ctx: AdmissionContext) -> Refusal | None:
        priority = ctx.ticket.priority
        if not self._gate.admitting(priority):
            fraction = self._gate.last_fraction or 0.0
            return Refusal(ErrorCode.RESOURCE_EXHAUSTED, "memory_pressure",
                           f"node is shedding {priority.name.lower()} work: memory at {fraction:.1%}",
                           self._state.config.pressure_retry_after_s)
        # the last sample was below the mark, but what was admitted since may not be
        if not self._projection.enabled:
            return None
        projected = self._projection.fraction(self._gate.last_fraction)
        config = self._state.config
        if projected is not None and projected >= config.shed_at(priority):
            return Refusal(ErrorCode.RESOURCE_EXHAUSTED, "projected_memory_pressure",
                           f"node is not taking more {priority.name.lower()} work until the next memory sample: "
                           f"{projected:.1%} projected", config.pressure_retry_after_s)
        return None


# ============================================================================ ordering
#: Engine priorities of different classes never interleave: class * CLASS_STRIDE + rank.
CLASS_STRIDE = 10**12


@_register(ORDERINGS, "priority-class")
class ClassOrdering:
    """vLLM priority = the class value (high 0, normal 1, low 2); FCFS within a class."""

    def __init__(self, state: SharedState) -> None:
        pass

    def engine_priority(self, ticket: Ticket) -> int:
        return int(ticket.priority)


@_register(ORDERINGS, "priority-deadline")
class DeadlineOrdering:
    """Classes first, then earliest deadline first within a class, with a fairness bound.

    The rank is ``min(deadline, arrived + deadline_fairness_s)`` in monotonic milliseconds, so
    two tickets compare whenever they were admitted; a request without a deadline ranks at
    ``arrived + deadline_fairness_s``. A deadline (even a TTFT budget, which costs nothing once
    the first token is out) thus moves a request ahead only of requests that arrived at most
    ``deadline_fairness_s`` before it. A ticket with no arrival time ranks by its deadline alone,
    no deadline last. Classes never interleave (``CLASS_STRIDE``).
    """

    def __init__(self, state: SharedState) -> None:
        self._state = state

    def engine_priority(self, ticket: Ticket) -> int:
        # The earlier of the deadline and arrival + fairness. A non-finite deadline ranks as none (the
        # headers refuse them; this keeps the plugin total).
        earliest = ticket.deadline
        if earliest is not None and not math.isfinite(earliest):
            earliest = None
        arrived = ticket.arrived
        if arrived is not None and math.isfinite(arrived):
            arrived += self._state.config.deadline_fairness_s
            if earliest is None or arrived < earliest:
                earliest = arrived
        rank = CLASS_STRIDE - 1
        if earliest is not None:
            rank = min(CLASS_STRIDE - 1, max(0, int(earliest * 1000)))
        return int(ticket.priority) * CLASS_STRIDE + rank


# ============================================================================ victims
@_register(VICTIM_PICKERS, "largest-first")
class LargestFirst:
    """Preempt the streams holding the most tokens (prompt + generated) first: they free the
    most KV cache per reset. Ties are broken by stream key, so the choice is deterministic."""

    def __init__(self, state: SharedState) -> None:
        pass

    def pick(self, running, priority, limit, exclude):
        candidates = [s for s in running if s.priority is priority and s.stream_key not in exclude]
        candidates.sort(key=lambda s: (-s.tokens_so_far, s.stream_key))
        return candidates[:max(0, limit)]
