"""The scheduler's counters, in a prometheus_client registry the server mounts on /metrics.

Every decision is counted: admitted, refused and preempted, labelled by reason and priority.
The server sends exactly one reset per preemption returned by ``observe``/``expired``, so
``zerolayer_scheduler_preempted_total`` equals the number of resets sent for those reasons.

Reaction time is measured inside the process, on the monotonic clock:

* ``zerolayer_scheduler_shed_decision_seconds``: sample taken -> the gate flipped (how long
  the sample took to reach ``observe``, thread hop included);
* ``zerolayer_scheduler_reaction_seconds``: sample that crossed the mark -> the first stream
  refused for pressure after it (the reference's "3.2 ms"). It includes waiting for the next
  request of that class to arrive, so under load it is close to the decision time.
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from zerolayer.contract import Priority
from zerolayer.runtime.counting import PendingIncrements

#: 10 µs .. 1 s: the interesting range is far below the reference's 3.2 ms.
REACTION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                    0.5, 1.0)


def _p(priority: Priority) -> str:
    return priority.name.lower()


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, keep_samples: int = 10_000) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._pending = PendingIncrements(r)  # before the counters it feeds (see counting.py)
        self.admitted = Counter("zerolayer_scheduler_admitted", "Streams admitted, by priority and stage",
                                ["priority", "stage"], registry=r)
        self.refused = Counter("zerolayer_scheduler_refused", "Streams refused at admission, by reason and priority",
                               ["reason", "priority", "code"], registry=r)
        self.preempted = Counter("zerolayer_scheduler_preempted",
                                 "Running streams preempted (one RST_STREAM each), by reason and priority",
                                 ["reason", "priority", "code"], registry=r)
        self.quota_refused = Counter("zerolayer_scheduler_quota_refused",
                                     "Streams refused because the tenant's quota is spent (429), by tenant and limit",
                                     ["tenant", "reason"], registry=r)
        self.transitions = Counter("zerolayer_scheduler_shed_transitions",
                                   "Pressure gate changes of state, by priority and new state",
                                   ["priority", "state"], registry=r)
        self.admitting = Gauge("zerolayer_scheduler_admitting", "1 if new streams of the priority are admitted",
                               ["priority"], registry=r)
        self.memory_fraction = Gauge("zerolayer_scheduler_memory_fraction",
                                     "Last memory fraction observed (GPU memory or KV cache)", registry=r)
        self.open_streams = Gauge("zerolayer_scheduler_open_streams", "Streams admitted and not yet settled",
                                  registry=r)
        self.reaction = Histogram("zerolayer_scheduler_reaction_seconds",
                                  "Sample crossing a shed mark -> first stream refused for pressure",
                                  ["priority"], buckets=REACTION_BUCKETS, registry=r)
        self.decision = Histogram("zerolayer_scheduler_shed_decision_seconds",
                                  "Sample taken -> pressure gate flipped in observe()",
                                  buckets=REACTION_BUCKETS, registry=r)
        for priority in Priority:
            self.admitting.labels(_p(priority)).set(1)
        for priority in (Priority.LOW, Priority.NORMAL):  # the classes that can be shed: export zeros from start
            self.reaction.labels(_p(priority))
        self._admitted_children: dict[tuple[Priority, str], Any] = {}
        #: raw reaction times (seconds) for benches; prometheus buckets are too coarse for percentiles
        self.reaction_samples: collections.deque[float] = collections.deque(maxlen=keep_samples)

    def count_admitted(self, priority: Priority, stage: str) -> None:
        child = self._admitted_children.get((priority, stage))  # twice per request: its child, looked up once
        if child is None:
            child = self._admitted_children[(priority, stage)] = self.admitted.labels(_p(priority), stage)
        self._pending.add(child)  # counted at the next read of the registry (counting.py)

    def count_refused(self, reason: str, priority: Priority, code: str) -> None:
        self.refused.labels(reason, _p(priority), code).inc()

    def count_quota_refused(self, tenant: str, reason: str) -> None:
        self.quota_refused.labels(tenant, reason).inc()

    def count_preempted(self, reason: str, priority: Priority, code: str) -> None:
        self.preempted.labels(reason, _p(priority), code).inc()

    def gate_changed(self, priority: Priority, shedding: bool, decision_s: float) -> None:
        self.transitions.labels(_p(priority), "shedding" if shedding else "admitting").inc()
        self.admitting.labels(_p(priority)).set(0 if shedding else 1)
        if shedding:
            self.decision.observe(max(0.0, decision_s))

    def reacted(self, priority: Priority, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.reaction.labels(_p(priority)).observe(seconds)
        self.reaction_samples.append(seconds)
