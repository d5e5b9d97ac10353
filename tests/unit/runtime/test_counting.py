"""Per-request counter increments and histogram observations wait in :class:`PendingIncrements` until the
registry is read (issue 29): every reader sees them, and the exposition is what ``child.inc`` and
``Histogram.observe`` gave."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from zerolayer.contract import Priority
from zerolayer.runtime.counting import MAX_OBSERVATIONS, PendingIncrements
from zerolayer.runtime.scheduler.metrics import SchedulerMetrics
from zerolayer.runtime.serving.metrics import RuntimeMetrics


def test_increments_reach_every_reader_of_the_registry():
    registry = CollectorRegistry(auto_describe=True)
    pending = PendingIncrements(registry)
    hits = Counter("hits", "Hits.", ["kind"], registry=registry)
    a, b = hits.labels("a"), hits.labels("b")
    for _ in range(3):
        pending.add(a)
    pending.add(b, 2.5)
    assert a._value.get() == 0  # not yet: moved in when the registry is read
    assert registry.get_sample_value("hits_total", {"kind": "a"}) == 3
    pending.add(a)
    page = generate_latest(registry).decode()
    assert 'hits_total{kind="a"} 4.0' in page and 'hits_total{kind="b"} 2.5' in page
    assert registry.get_sample_value("hits_total", {"kind": "a"}) == 4  # moved once, not twice


def test_the_same_page_as_incrementing_at_once():
    def page(deferred: bool) -> bytes:
        metrics = RuntimeMetrics()
        if not deferred:
            metrics._pending.add = lambda child, amount=1.0: child.inc(amount)  # type: ignore[method-assign]
        for status in (200, 200, 429):
            metrics.count_request("chat", status)
        metrics.count_tokens("acme", "prompt", 12)
        metrics.count_tokens("acme", "completion", 16)
        metrics.count_tokens("acme", "completion", 4)
        return b"\n".join(line for line in metrics.render().splitlines() if b"_created" not in line)

    assert page(deferred=True) == page(deferred=False)
    metrics = RuntimeMetrics()
    metrics.count_tokens("acme", "completion", 16)
    assert metrics.value("zerolayer_tokens_total", tenant="acme", kind="completion") == 16


def test_scheduler_admissions_are_counted_when_read():
    metrics = SchedulerMetrics()
    metrics.count_admitted(Priority.HIGH, "headers")
    metrics.count_admitted(Priority.HIGH, "body")
    metrics.count_admitted(Priority.HIGH, "body")
    value = metrics.registry.get_sample_value
    assert value("zerolayer_scheduler_admitted_total", {"priority": "high", "stage": "body"}) == 2
    assert value("zerolayer_scheduler_admitted_total", {"priority": "high", "stage": "headers"}) == 1


def test_observations_reach_every_reader_and_stay_bounded():
    registry = CollectorRegistry(auto_describe=True)
    pending = PendingIncrements(registry)
    latency = Histogram("latency_seconds", "Latency.", buckets=(0.01, 0.1), registry=registry)
    pending.observe(latency, 0.005)
    pending.observe(latency, 0.05)
    assert latency._sum.get() == 0  # not yet: applied when the registry is read
    assert registry.get_sample_value("latency_seconds_bucket", {"le": "0.01"}) == 1
    assert registry.get_sample_value("latency_seconds_count") == 2
    assert registry.get_sample_value("latency_seconds_count") == 2  # applied once, not twice
    for _ in range(MAX_OBSERVATIONS):  # nobody reads: applied once the list is full, never held past it
        pending.observe(latency, 1.0)
    assert latency._sum.get() == pytest.approx(0.055 + MAX_OBSERVATIONS)
    assert len(pending._observed) == 0


def test_time_histograms_give_the_page_observing_at_once_gives():
    def page(deferred: bool) -> bytes:
        metrics = RuntimeMetrics()
        if not deferred:
            metrics._pending.observe = lambda histogram, value: histogram.observe(value)  # type: ignore[method-assign]
        for seconds in (0.0004, 0.001, 0.02, 3.0, 99.0, 0.02):  # a bound itself goes in its own bucket
            metrics.observe_ttft(seconds)
            metrics.observe_tpot(seconds / 10)
        return b"\n".join(line for line in metrics.render().splitlines() if b"_created" not in line)

    assert page(deferred=True) == page(deferred=False)
