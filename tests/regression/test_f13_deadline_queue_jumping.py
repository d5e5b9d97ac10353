"""Finding 13: a TTFT deadline cannot buy a place ahead of everyone else without bound.

On 410a271 ``priority-deadline`` ranked any request with a deadline (e.g. ``x-slo-ttft-ms: 50``,
which stops applying after the first token and so costs nothing) ahead of every no-deadline
request of its class, however long those had waited: other tenants could starve in vLLM's
queue and be preempted first.

The fix ranks every request by ``min(deadline, arrival + deadline_fairness_s)``: a deadline
moves a request ahead of requests that arrived at most ``deadline_fairness_s`` before it, never
further.
"""

from __future__ import annotations

import dataclasses

import pytest

from zerolayer.contract import Priority
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, Ticket

pytestmark = pytest.mark.regression


def ticket(key: str, tenant: str, arrived: float, deadline: float | None) -> Ticket:
    fields = {f.name for f in dataclasses.fields(Ticket)}
    extra = {"arrived": arrived} if "arrived" in fields else {}
    return Ticket(key, tenant, Priority.NORMAL, "m", 10, 10, deadline, **extra)


def config(**values: float) -> SchedulerConfig:
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return SchedulerConfig(**{k: v for k, v in values.items() if k in known})


def test_a_ttft_deadline_does_not_outrank_requests_waiting_longer_than_the_fairness_bound():
    scheduler = MicroScheduler(config(deadline_fairness_s=5.0))
    waiting = ticket("1/1", "patient", arrived=1000.0, deadline=None)
    jumper = ticket("2/1", "jumper", arrived=1030.0, deadline=1030.05)  # x-slo-ttft-ms: 50, 30 s later
    assert scheduler.engine_priority(waiting) < scheduler.engine_priority(jumper)


def test_within_the_bound_the_earlier_deadline_still_goes_first():
    scheduler = MicroScheduler(config(deadline_fairness_s=5.0))
    waiting = ticket("1/1", "patient", arrived=1000.0, deadline=None)
    urgent = ticket("2/1", "urgent", arrived=1001.0, deadline=1001.05)
    assert scheduler.engine_priority(urgent) < scheduler.engine_priority(waiting)


def test_classes_still_never_interleave():
    scheduler = MicroScheduler(config(deadline_fairness_s=5.0))
    high = dataclasses.replace(ticket("1/1", "a", arrived=2000.0, deadline=None), priority=Priority.HIGH)
    normal = ticket("2/1", "b", arrived=0.0, deadline=0.01)
    assert scheduler.engine_priority(high) < scheduler.engine_priority(normal)
