"""Test factories (vLLM-style ``create_*``): tiny tickets and schedulers with no engine."""

from __future__ import annotations

import itertools

from zerolayer.contract import Priority
from zerolayer.runtime.scheduler import MicroScheduler, Pressure, RunningStream, SchedulerConfig, TenantPolicy, Ticket

_keys = itertools.count()


def ticket(priority: Priority = Priority.NORMAL, *, tenant: str = "acme", model: str = "tiny", prompt: int = 10,
           max_tokens: int = 20, deadline: float | None = None, key: str | None = None) -> Ticket:
    return Ticket(key or f"s{next(_keys)}", tenant, priority, model, prompt, max_tokens, deadline)


def scheduler(tenants: dict[str, TenantPolicy] | None = None, **config) -> MicroScheduler:
    return MicroScheduler(SchedulerConfig(**config), tenants=tenants)


def running(key: str, priority: Priority, tokens: int, deadline: float | None = None) -> RunningStream:
    return RunningStream(key, priority, tokens, deadline)


def pressure(fraction: float, at: float, streams=(), waiting: int = 0) -> Pressure:
    return Pressure(fraction, tuple(streams), waiting, at)


def sample_value(registry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def admitted(sched: MicroScheduler, streams):
    """Admit a ticket for each running stream (the scheduler only stops streams it admitted)."""
    for s in streams:
        adm = sched.admit(Ticket(s.stream_key, "acme", s.priority, "tiny", 1, 1, None), now=0.0)
        assert adm.admitted, adm
    return list(streams)
