"""Table-driven tests of each plugin on its own."""

from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler_factories import pressure, running, ticket
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.scheduler import PressureGate, SchedulerConfig, SchedulerConfigError, TenantPolicy
from zerolayer.runtime.scheduler.plugins import (CLASS_STRIDE, FILTERS, ORDERINGS, VICTIM_PICKERS, AdmissionContext,
                                                 SharedState, build_filters)
from zerolayer.runtime.scheduler.quota import QuotaLedger

H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW


def state(**config) -> SharedState:
    cfg = SchedulerConfig(**config)
    return SharedState(cfg, PressureGate.from_config(cfg), QuotaLedger(cfg.quota_window_s))


def ctx(t, policy=None, *, now=100.0, load=None, readmission=False, stage="headers") -> AdmissionContext:
    return AdmissionContext(t, now, stage, policy, readmission, load)


def test_every_plugin_is_registered_under_its_type_name():
    for table in (FILTERS, ORDERINGS, VICTIM_PICKERS):
        for name, cls in table.items():
            assert cls.type_name == name
    assert {"permission", "quota", "deadline", "pressure"} <= set(FILTERS)


def test_unknown_plugin_is_a_config_error():
    with pytest.raises(SchedulerConfigError, match="unknown filter 'nope'"):
        build_filters(state(filters=("permission", "nope")))


# ------------------------------------------------------------------ permission
ONLY_NORMAL_LOW = TenantPolicy("acme", allowed_priorities=frozenset({N, L}), allowed_models=frozenset({"tiny"}))


@pytest.mark.parametrize("policy, unknown_allowed, t, reason", [
    (None, True, ticket(H), None),
    (None, False, ticket(H), "unknown_tenant"),
    (TenantPolicy("acme"), True, ticket(H, model="anything"), None),
    (ONLY_NORMAL_LOW, True, ticket(N), None),
    (ONLY_NORMAL_LOW, True, ticket(H), "priority_not_allowed"),
    (ONLY_NORMAL_LOW, True, ticket(L, model="big"), "model_not_allowed"),
])
def test_permission_filter(policy, unknown_allowed, t, reason):
    f = FILTERS["permission"](state(unknown_tenants_allowed=unknown_allowed))
    refusal = f.check(ctx(t, policy))
    assert (refusal.reason if refusal else None) == reason
    if refusal:
        assert refusal.code is ErrorCode.PERMISSION_DENIED
        assert t.tenant in refusal.message


# ------------------------------------------------------------------ deadline
@pytest.mark.parametrize("deadline, prompt, waiting, reason", [
    (None, 10_000, 50, None),
    (100.5, 100, 0, None),                 # 0.5 s left, needs ~27 ms
    (100.0, 10, 0, "deadline_passed"),     # deadline is now
    (99.0, 10, 0, "deadline_passed"),
    (100.01, 400, 0, "deadline_unreachable"),  # 10 ms left, prefill alone takes 100 ms
    (100.05, 10, 10, "deadline_unreachable"),  # 10 waiting * 10 ms each
    (100.2, 10, 10, None),
])
def test_deadline_filter(deadline, prompt, waiting, reason):
    f = FILTERS["deadline"](state(prefill_tokens_per_s=4000, min_first_token_s=0.002, queue_delay_per_waiting_s=0.01))
    refusal = f.check(ctx(ticket(prompt=prompt, deadline=deadline), load=pressure(0.1, 99.9, waiting=waiting)))
    assert (refusal.reason if refusal else None) == reason
    if refusal:
        assert refusal.code is ErrorCode.DEADLINE_EXCEEDED


# ------------------------------------------------------------------ pressure
@pytest.mark.parametrize("fractions, priority, refused", [
    ([0.5], L, False),
    ([0.92], L, True),                 # at the mark counts
    ([0.95], N, False),
    ([0.97], N, True),
    ([0.999], H, False),               # high is never shed
    ([0.95, 0.90], L, True),           # inside the hysteresis band: still shedding
    ([0.95, 0.87], L, False),          # below resume mark: admitting again
])
def test_pressure_filter(fractions, priority, refused):
    s = state()
    for i, fraction in enumerate(fractions):
        s.gate.update(fraction, float(i))
    refusal = FILTERS["pressure"](s).check(ctx(ticket(priority)))
    assert (refusal is not None) == refused
    if refusal:
        assert refusal.code is ErrorCode.RESOURCE_EXHAUSTED
        assert refusal.retry_after_s == 1.0


# ------------------------------------------------------------------ quota (filter wiring; ledger has its own tests)
@pytest.mark.parametrize("policy, already, t, reason", [
    (TenantPolicy("acme", tokens_per_minute=100), 0, ticket(prompt=10, max_tokens=20), None),
    (TenantPolicy("acme", tokens_per_minute=100), 80, ticket(prompt=10, max_tokens=20), "tokens"),
    (TenantPolicy("acme", tokens_per_minute=100), 0, ticket(prompt=50, max_tokens=60), "request_too_large"),
    (TenantPolicy("acme", requests_per_minute=1), 1, ticket(), "requests"),
    (TenantPolicy("acme", max_concurrent_streams=1), 1, ticket(), "concurrency"),
])
def test_quota_filter(policy, already, t, reason):
    s = state()
    if already:
        s.ledger.tenant("acme").charge("earlier", already, 99.0, new_request=True)
    refusal = FILTERS["quota"](s).check(ctx(t, policy))
    assert (refusal.reason if refusal else None) == reason
    if refusal:
        assert refusal.code is ErrorCode.RATE_LIMITED


# ------------------------------------------------------------------ ordering
@pytest.mark.parametrize("name, tickets_in_engine_order", [
    ("priority-class", [ticket(H), ticket(N), ticket(L)]),
    ("priority-deadline", [ticket(H, deadline=5.0), ticket(H, deadline=9.0), ticket(H), ticket(N, deadline=1.0),
                           ticket(L, deadline=0.5)]),
])
def test_ordering_policies(name, tickets_in_engine_order):
    policy = ORDERINGS[name](state())
    values = [policy.engine_priority(t) for t in tickets_in_engine_order]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_class_ordering_is_vllm_convention():
    policy = ORDERINGS["priority-class"](state())
    assert [policy.engine_priority(ticket(p)) for p in (H, N, L)] == [0, 1, 2]



def _earliest_rank(deadline, arrived, fairness):  # the rank as the ordering documents it, written plainly
    candidates = [d for d in (deadline,) if d is not None and math.isfinite(d)]
    if arrived is not None and math.isfinite(arrived):
        candidates.append(arrived + fairness)
    return min(CLASS_STRIDE - 1, max(0, int(min(candidates) * 1000))) if candidates else CLASS_STRIDE - 1


@pytest.mark.parametrize("deadline", [None, 0.5, 12.0, 5000.0, math.inf, -math.inf, math.nan, -3.0])
@pytest.mark.parametrize("arrived", [None, 0.0, 11.0, 4000.0, math.inf, math.nan])
def test_deadline_ordering_ranks_by_the_earlier_of_deadline_and_fair_arrival(deadline, arrived):
    s = state()
    policy = ORDERINGS["priority-deadline"](s)
    t = dataclasses.replace(ticket(N, deadline=deadline), arrived=arrived)
    fairness = s.config.deadline_fairness_s
    assert policy.engine_priority(t) == int(N) * CLASS_STRIDE + _earliest_rank(deadline, arrived, fairness)


# ------------------------------------------------------------------ victims
@pytest.mark.parametrize("streams, priority, limit, exclude, expected", [
    ([running("a", L, 10), running("b", L, 300), running("c", L, 50)], L, 2, set(), ["b", "c"]),
    ([running("a", L, 10), running("b", L, 300), running("c", N, 999)], L, 5, set(), ["b", "a"]),
    ([running("a", L, 10), running("b", L, 300)], L, 2, {"b"}, ["a"]),
    ([running("a", H, 10)], H, 2, set(), ["a"]),  # the picker is told which class; the scheduler never asks for H
    ([running("x", L, 7), running("w", L, 7)], L, 1, set(), ["w"]),
    ([running("a", L, 10)], L, 0, set(), []),
])
def test_largest_first(streams, priority, limit, exclude, expected):
    picker = VICTIM_PICKERS["largest-first"](state())
    assert [s.stream_key for s in picker.pick(streams, priority, limit, exclude)] == expected
