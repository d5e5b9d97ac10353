"""Shedding under memory pressure: the gate, preemption, hysteresis, counters, reaction time."""

from __future__ import annotations

import pytest

from scheduler_factories import admitted, pressure, running, sample_value, scheduler, ticket
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.scheduler import PressureGate, SchedulerConfig

H, N, L = Priority.HIGH, Priority.NORMAL, Priority.LOW


@pytest.mark.parametrize("samples, low_admitting, normal_admitting", [
    ([], True, True),
    ([0.5, 0.8, 0.91], True, True),
    ([0.5, 0.92], False, True),
    ([0.95, 0.90, 0.89], False, True),          # hysteresis band 0.88..0.92 keeps shedding
    ([0.95, 0.879], True, True),
    ([0.97], False, False),
    ([0.98, 0.95], False, False),               # normal band 0.93..0.97
    ([0.98, 0.92], False, True),                # normal resumed, low still in its band
    ([0.98, 0.5], True, True),
])
def test_gate_table(samples, low_admitting, normal_admitting):
    gate = PressureGate.from_config(SchedulerConfig())
    for i, fraction in enumerate(samples):
        gate.update(fraction, float(i))
    assert gate.admitting(L) is low_admitting
    assert gate.admitting(N) is normal_admitting
    assert gate.admitting(H)


def test_wobbling_reading_does_not_flap():
    sched = scheduler()
    wobble = [0.93, 0.91, 0.925, 0.90, 0.921, 0.89, 0.93, 0.915]
    for i, fraction in enumerate(wobble):
        sched.observe(pressure(fraction, float(i)), now=float(i))
    reg = sched.registry
    assert sample_value(reg, "zerolayer_scheduler_shed_transitions_total", priority="low", state="shedding") == 1
    assert sample_value(reg, "zerolayer_scheduler_shed_transitions_total", priority="low", state="admitting") == 0
    sched.observe(pressure(0.87, 9.0), now=9.0)
    assert sample_value(reg, "zerolayer_scheduler_shed_transitions_total", priority="low", state="admitting") == 1


def test_new_low_refused_on_the_crossing_sample_and_resumed_below_the_lower_mark():
    sched = scheduler()
    climb = [0.5, 0.7, 0.85, 0.91, 0.93]
    verdicts = []
    for i, fraction in enumerate(climb):
        sched.observe(pressure(fraction, 10.0 + i), now=10.0 + i)
        verdicts.append(sched.admit(ticket(L), now=10.0 + i + 0.001).admitted)
    assert verdicts == [True, True, True, True, False]
    refused = sched.admit(ticket(L), now=15.0)
    assert refused.code is ErrorCode.RESOURCE_EXHAUSTED and refused.reason == "memory_pressure"
    assert refused.headers["retry-after"] == "1"
    assert sched.admit(ticket(N), now=15.0).admitted and sched.admit(ticket(H), now=15.0).admitted
    sched.observe(pressure(0.90, 16.0), now=16.0)
    assert not sched.admit(ticket(L), now=16.0).admitted
    sched.observe(pressure(0.85, 17.0), now=17.0)
    assert sched.admit(ticket(L), now=17.0).admitted


def test_running_low_preempted_largest_first_at_most_n_per_tick_only_if_pressure_persists():
    sched = scheduler(max_preemptions_per_tick=2, preempt_after_samples=2)
    streams = admitted(sched, [running("l1", L, 100), running("l2", L, 900), running("l3", L, 500),
                               running("n1", N, 5000), running("h1", H, 9000)])
    assert sched.observe(pressure(0.93, 1.0, streams), now=1.0) == []       # crossing sample: refuse only
    first = sched.observe(pressure(0.94, 2.0, streams), now=2.0)            # persists: preempt
    assert [(p.stream_key, p.code, p.reason) for p in first] == [
        ("l2", ErrorCode.GPU_OOM, "memory_pressure"), ("l3", ErrorCode.GPU_OOM, "memory_pressure")]
    # the server has not finished aborting yet: l2/l3 still listed, never returned twice
    second = sched.observe(pressure(0.94, 3.0, streams), now=3.0)
    assert [p.stream_key for p in second] == ["l1"]
    assert sched.observe(pressure(0.94, 4.0, streams), now=4.0) == []      # normal is below its mark: untouched


def test_normal_preempted_only_above_second_threshold_and_high_never():
    sched = scheduler(max_preemptions_per_tick=10, preempt_after_samples=1)
    streams = admitted(sched, [running("l1", L, 10), running("n1", N, 10), running("n2", N, 20), running("h1", H, 30)])
    out = sched.observe(pressure(0.999, 1.0, streams), now=1.0)
    assert [p.stream_key for p in out] == ["l1", "n2", "n1"]
    assert sched.observe(pressure(1.0, 2.0, streams), now=2.0) == []
    reg = sched.registry
    assert sample_value(reg, "zerolayer_scheduler_preempted_total", reason="memory_pressure", priority="low",
                        code="GPU_OOM") == 1
    assert sample_value(reg, "zerolayer_scheduler_preempted_total", reason="memory_pressure", priority="normal",
                        code="GPU_OOM") == 2
    assert sample_value(reg, "zerolayer_scheduler_preempted_total", reason="memory_pressure", priority="high",
                        code="GPU_OOM") == 0


def test_preemption_stops_inside_the_band_and_budget_zero_disables_it():
    sched = scheduler(preempt_after_samples=1)
    streams = admitted(sched, [running("l1", L, 10), running("l2", L, 20), running("l3", L, 30)])
    assert len(sched.observe(pressure(0.95, 1.0, streams), now=1.0)) == 2
    assert sched.observe(pressure(0.90, 2.0, streams), now=2.0) == []  # still refusing, no longer preempting
    off = scheduler(preempt_after_samples=1, max_preemptions_per_tick=0)
    admitted(off, streams)
    assert off.observe(pressure(0.99, 1.0, streams), now=1.0) == []


def test_preempted_counter_equals_preemptions_returned():
    sched = scheduler(preempt_after_samples=1, max_preemptions_per_tick=3)
    returned = 0
    batches = [admitted(sched, [running(f"s{i}-{j}", L, j) for j in range(5)]) for i in range(6)]
    for i, streams in enumerate(batches):
        returned += len(sched.observe(pressure(0.99, float(i), streams), now=float(i)))
    total = sum(sample_value(sched.registry, "zerolayer_scheduler_preempted_total", reason="memory_pressure",
                             priority=p, code="GPU_OOM") for p in ("low", "normal", "high"))
    assert total == returned == 18


def test_reaction_time_from_crossing_sample_to_first_refusal():
    sched = scheduler()
    sched.observe(pressure(0.95, 100.0), now=100.002)      # sample taken at 100.0, seen 2 ms later
    sched.admit(ticket(L), now=100.005)                     # first refusal: 5 ms after the sample
    sched.admit(ticket(L), now=100.5)                       # later refusals do not count again
    assert list(sched.metrics.reaction_samples) == [pytest.approx(0.005)]
    assert sample_value(sched.registry, "zerolayer_scheduler_reaction_seconds_count", priority="low") == 1
    assert sample_value(sched.registry, "zerolayer_scheduler_shed_decision_seconds_sum") == pytest.approx(0.002)
    sched.observe(pressure(0.5, 101.0), now=101.0)
    sched.observe(pressure(0.95, 102.0), now=102.0)
    sched.admit(ticket(L), now=102.001)
    assert len(sched.metrics.reaction_samples) == 2


def test_admitting_gauge_follows_the_gate():
    sched = scheduler()
    sched.observe(pressure(0.99, 1.0), now=1.0)
    assert sample_value(sched.registry, "zerolayer_scheduler_admitting", priority="low") == 0
    assert sample_value(sched.registry, "zerolayer_scheduler_admitting", priority="high") == 1
    assert not sched.admitting(L) and not sched.admitting(N) and sched.admitting(H)


def test_projection_refuses_a_burst_between_samples():
    sched = scheduler(kv_capacity_tokens=1000)
    sched.observe(pressure(0.80, 1.0), now=1.0)
    verdicts = [sched.admit(ticket(L, prompt=10, max_tokens=20), now=1.1 + i / 100).reason or "ok" for i in range(5)]
    assert verdicts == ["ok", "ok", "ok", "ok", "projected_memory_pressure"]  # 0.80 + 4 * 30 / 1000 = 0.92
    assert sched.admit(ticket(N, prompt=10, max_tokens=20), now=1.2).admitted  # normal's mark is 0.97
    assert sched.admit(ticket(H, prompt=500, max_tokens=500), now=1.2).admitted  # high is never refused
    # a sample taken after the burst already contains it: the projection starts again from that sample
    sched.observe(pressure(0.85, 1.3), now=1.3)
    assert sched.admit(ticket(L, prompt=10, max_tokens=20), now=1.31).admitted


def test_projection_keeps_admissions_newer_than_the_sample():
    sched = scheduler(kv_capacity_tokens=100)
    sched.observe(pressure(0.5, 1.0), now=1.0)
    assert sched.admit(ticket(L, prompt=10, max_tokens=10), now=2.0).admitted    # +0.20
    assert sched.admit(ticket(L, prompt=10, max_tokens=10), now=3.0).admitted    # +0.20 -> 0.90
    sched.observe(pressure(0.71, 2.5), now=3.1)  # sampled before the second admission: 0.71 + 0.20
    assert sched.admit(ticket(L, prompt=1, max_tokens=1), now=3.2).admitted     # 0.91 < 0.92, now 0.93
    assert sched.admit(ticket(L, prompt=1, max_tokens=1), now=3.3).reason == "projected_memory_pressure"


def test_projection_is_off_by_default():
    sched = scheduler()
    sched.observe(pressure(0.91, 1.0), now=1.0)
    assert all(sched.admit(ticket(L, prompt=1000, max_tokens=1000), now=1.1).admitted for _ in range(10))


def test_a_stream_settled_since_the_snapshot_is_not_preempted():
    sched = scheduler(preempt_after_samples=1)
    adm = sched.admit(ticket(L, key="gone"), now=0.0)
    streams = admitted(sched, [running("stays", L, 10)]) + [running("gone", L, 999)]
    sched.settle(adm.reservation, 5, now=0.5)  # ended while the server was sampling
    assert [p.stream_key for p in sched.observe(pressure(0.99, 1.0, streams), now=1.0)] == ["stays"]
    assert sched.expired([running("gone", L, 1, deadline=0.0)], now=2.0) == []
