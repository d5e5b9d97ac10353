"""MicroScheduler as a whole: protocol conformance, admission stages, settling, deadlines, config."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from scheduler_factories import admitted, pressure, running, sample_value, scheduler, ticket
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.scheduler import (MicroScheduler, Scheduler, SchedulerConfig, SchedulerConfigError,
                                         SchedulerError, TenantPolicy)

H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW


def test_implements_the_protocol():
    sched: Scheduler = MicroScheduler()
    for name in ("set_tenants", "admit", "settle", "observe", "expired"):
        assert callable(getattr(sched, name))
    assert sched.filter_names == ["permission", "quota", "deadline", "pressure"]


def test_admission_carries_engine_priority_and_reservation():
    sched = scheduler()
    adm = sched.admit(ticket(H, prompt=7, max_tokens=9, deadline=50.0), now=1.0)
    assert adm.admitted and adm.reservation.reserved_tokens == 16 and adm.reservation.window_start == 1.0
    later = sched.admit(ticket(L), now=1.0)
    assert adm.engine_priority < later.engine_priority


def test_first_refusal_wins_in_filter_order():
    sched = scheduler({"acme": TenantPolicy("acme", allowed_priorities=frozenset({H}), requests_per_minute=0)})
    assert sched.admit(ticket(L), now=1.0).code is ErrorCode.PERMISSION_DENIED
    assert sched.admit(ticket(H), now=1.0).code is ErrorCode.RATE_LIMITED


def test_settle_is_idempotent_and_unknown_streams_are_ignored():
    sched = scheduler({"acme": TenantPolicy("acme", max_concurrent_streams=1)})
    adm = sched.admit(ticket(key="k"), now=0.0)
    sched.settle(adm.reservation, 3, now=0.1)
    sched.settle(adm.reservation, 3, now=0.2)
    assert sched.open_streams() == 0
    assert sched.admit(ticket(key="k2"), now=0.3).admitted


def test_unknown_stage_is_an_error():
    with pytest.raises(SchedulerError, match="stage"):
        scheduler().admit(ticket(), now=0.0, stage="trailers")


def test_expired_returns_each_late_stream_once_and_counts_it():
    sched = scheduler()
    streams = admitted(sched, [running("a", H, 10, deadline=5.0), running("b", L, 10, deadline=9.0),
                               running("c", N, 10)])
    out = sched.expired(streams, now=6.0)
    assert [(p.stream_key, p.code, p.reason) for p in out] == [("a", ErrorCode.DEADLINE_EXCEEDED, "deadline")]
    assert sched.expired(streams, now=6.5) == []
    assert [p.stream_key for p in sched.expired(streams, now=9.0)] == ["b"]
    assert sample_value(sched.registry, "zerolayer_scheduler_preempted_total", reason="deadline", priority="high",
                        code="DEADLINE_EXCEEDED") == 1


def test_a_stream_preempted_for_deadline_is_not_preempted_again_for_pressure():
    sched = scheduler(preempt_after_samples=1)
    streams = admitted(sched, [running("a", L, 10, deadline=1.0)])
    assert len(sched.expired(streams, now=2.0)) == 1
    assert sched.observe(pressure(0.99, 2.0, streams), now=2.0) == []


def test_deadline_refusal_is_counted():
    sched = scheduler()
    adm = sched.admit(ticket(N, deadline=0.5), now=1.0)
    assert adm.code is ErrorCode.DEADLINE_EXCEEDED and adm.reason == "deadline_passed"
    assert sample_value(sched.registry, "zerolayer_scheduler_refused_total", reason="deadline_passed",
                        priority="normal", code="DEADLINE_EXCEEDED") == 1


def test_waiting_queue_from_telemetry_feeds_the_deadline_estimate():
    sched = scheduler(queue_delay_per_waiting_s=0.05)
    assert sched.admit(ticket(deadline=1.2), now=1.0).admitted
    sched.observe(pressure(0.1, 1.0, waiting=10), now=1.0)
    assert sched.admit(ticket(deadline=1.2), now=1.0).reason == "deadline_unreachable"


def test_metrics_render_in_prometheus_text():
    sched = scheduler()
    sched.admit(ticket(), now=0.0)
    text = generate_latest(sched.registry).decode()
    for name in ("zerolayer_scheduler_admitted_total", "zerolayer_scheduler_reaction_seconds_bucket",
                 "zerolayer_scheduler_admitting"):
        assert name in text


def test_set_tenants_replaces_policies():
    sched = scheduler()
    assert sched.admit(ticket(H), now=0.0).admitted
    sched.set_tenants({"acme": TenantPolicy("acme", allowed_priorities=frozenset({L}))})
    assert sched.admit(ticket(H), now=0.0).code is ErrorCode.PERMISSION_DENIED


@pytest.mark.parametrize("data, expected", [
    (None, SchedulerConfig()),
    ({"lowShedAt": 0.9, "lowResumeBelow": "0.8"}, SchedulerConfig(low_shed_at=0.9, low_resume_below=0.8)),
    ({"filters": ["pressure"], "max_preemptions_per_tick": 4},
     SchedulerConfig(filters=("pressure",), max_preemptions_per_tick=4)),
    ({"unknownTenantsAllowed": False}, SchedulerConfig(unknown_tenants_allowed=False)),
    ({"kvCapacityTokens": "4096"}, SchedulerConfig(kv_capacity_tokens=4096)),
])
def test_config_from_mapping(data, expected):
    assert SchedulerConfig.from_mapping(data) == expected


@pytest.mark.parametrize("data, message", [
    ({"lowShedAt": 0.8}, "low_resume_below < low_shed_at"),     # resume (0.88) above shed
    ({"normalShedAt": 0.9, "normalResumeBelow": 0.85}, "must not be below low_shed_at"),
    ({"lowShedAt": 1.2}, "<= 1"),
    ({"lowShedAtt": 0.9}, "unknown scheduler setting 'lowShedAtt'"),
    ({"preemptAfterSamples": 0}, "preempt_after_samples"),
    ({"lowShedAt": "high"}, "lowShedAt"),
    ({"unknownTenantsAllowed": "yes"}, "true or false"),
])
def test_config_errors(data, message):
    with pytest.raises(SchedulerConfigError, match=message):
        SchedulerConfig.from_mapping(data)
