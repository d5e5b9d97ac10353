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


def test_reconfigure_reaches_every_filter_at_the_next_admission():
    """An edited InferenceNode's scheduler section applies without a restart, in each filter: the
    deadline estimate, the pressure refusal's retry-after and projected marks, unknown tenants."""
    sched = scheduler({"acme": TenantPolicy("acme")}, min_first_token_s=0.0, pressure_retry_after_s=1.0,
                      kv_capacity_tokens=1000)
    assert sched.admit(ticket(prompt=0, deadline=1.1), now=1.0).admitted
    assert sched.admit(ticket(tenant="stranger"), now=1.0).admitted
    sched.observe(pressure(0.95, 1.0), now=1.0)
    assert sched.admit(ticket(L), now=1.0).retry_after_s == 1.0
    assert sched.admit(ticket(N, prompt=0, max_tokens=1), now=1.0).admitted  # 0.95 + 1/1000 < 0.97

    sched.reconfigure(SchedulerConfig(min_first_token_s=0.5, pressure_retry_after_s=7.0, kv_capacity_tokens=1000,
                                      normal_shed_at=0.95, normal_resume_below=0.9, low_shed_at=0.93,
                                      low_resume_below=0.9, unknown_tenants_allowed=False))
    assert sched.admit(ticket(prompt=0, deadline=1.1), now=1.0).reason == "deadline_unreachable"
    assert sched.admit(ticket(L), now=1.0).retry_after_s == 7.0
    refused = sched.admit(ticket(N, prompt=0, max_tokens=1), now=1.0)
    assert refused.reason == "projected_memory_pressure" and refused.retry_after_s == 7.0
    assert sched.admit(ticket(tenant="stranger"), now=1.0).code is ErrorCode.PERMISSION_DENIED


def test_reconfigure_rebuilds_the_plugin_chain_and_retunes_the_quota_window():
    sched = scheduler({"acme": TenantPolicy("acme", requests_per_minute=1)}, concurrency_retry_after_s=1.0)
    sched.observe(pressure(0.99, 1.0), now=1.0)
    assert sched.admit(ticket(L), now=1.0).reason == "memory_pressure"
    first = sched.admit(ticket(H), now=1.0)
    sched.settle(first.reservation, 1, now=1.5)
    assert sched.admit(ticket(H), now=20.0).reason == "requests"  # one request per 60 s window

    sched.reconfigure(SchedulerConfig(filters=("permission", "quota", "deadline"), ordering="priority-class",
                                      quota_window_s=10.0))  # shedding off, a 10 s window
    assert sched.filter_names == ["permission", "quota", "deadline"]
    assert sched.admit(ticket(L), now=20.0).admitted  # no pressure filter; the 1.0 charge left the window
    assert sched.engine_priority(ticket(L, deadline=5.0)) == int(L)


def test_reconfigure_with_an_unknown_plugin_applies_nothing():
    sched = scheduler(min_first_token_s=0.0)
    with pytest.raises(SchedulerConfigError, match="unknown filter 'fast-lane'"):
        sched.reconfigure(SchedulerConfig(filters=("permission", "fast-lane"), min_first_token_s=0.5))
    assert sched.filter_names == ["permission", "quota", "deadline", "pressure"]
    assert sched.config.min_first_token_s == 0.0
    assert sched.admit(ticket(prompt=0, deadline=1.1), now=1.0).admitted


def test_open_streams_gauge_counts_admitted_not_settled():
    sched = scheduler()
    first = sched.admit(ticket(), now=0.0)
    sched.admit(ticket(), now=0.0)
    assert sample_value(sched.registry, "zerolayer_scheduler_open_streams") == 2
    sched.settle(first.reservation, 1, now=0.1)
    assert sample_value(sched.registry, "zerolayer_scheduler_open_streams") == 1


def test_sized_ticket_is_replace_with_every_other_field_kept():
    """Ticket.sized builds the body-stage ticket field by field: a field added to Ticket must be kept."""
    import dataclasses

    from zerolayer.runtime.scheduler import Ticket
    values = {"stream_key": "c/1", "tenant": "acme", "priority": L, "model": "a", "prompt_tokens": 1,
              "max_tokens": 2, "deadline": 3.0, "session": "s", "arrived": 4.0}
    assert set(values) == {f.name for f in dataclasses.fields(Ticket)}, "a new Ticket field: give it a value here"
    original = Ticket(**values)
    assert original.sized("b", H, 7, 9) == dataclasses.replace(original, model="b", priority=H, prompt_tokens=7,
                                                               max_tokens=9)
