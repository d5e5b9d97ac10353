"""Memory pressure: the hysteresis gate per priority class, and readings -> ``Pressure``.

The gate is a two-state machine per class (admitting / shedding). It enters *shedding* on
the first sample at or above the class's ``shed_at`` mark and leaves it on the first sample
below ``resume_below``; samples in between keep the current state, which is what stops a
reading that wobbles around one mark from flapping. ``HIGH`` has no marks and is never shed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from zerolayer.contract import Priority
from zerolayer.runtime.gpu.api import GpuReading
from zerolayer.runtime.gpu.signal import resolve_pressure_signal  # noqa: F401 (the scheduler's view of it)

from .api import Pressure, RunningStream
from .config import SchedulerConfig, SchedulerError, Watermarks

SHED_CLASSES = (Priority.LOW, Priority.NORMAL)  # lowest first: the order streams are shed in


@dataclasses.dataclass(frozen=True)
class Transition:
    """A class changed state on the sample taken at ``sampled_at``."""

    priority: Priority
    shedding: bool
    memory_fraction: float
    sampled_at: float


@dataclasses.dataclass
class _ClassState:
    marks: Watermarks
    shedding: bool = False
    samples_at_or_above: int = 0  # consecutive samples >= shed_at (drives preemption)


class PressureGate:
    """Admission state per priority class, driven by memory-fraction samples."""

    def __init__(self, marks: Mapping[Priority, Watermarks]) -> None:
        self._classes = {p: _ClassState(marks[p]) for p in SHED_CLASSES if p in marks}
        self.last_fraction: float | None = None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "PressureGate":
        return cls({p: config.watermarks(p) for p in SHED_CLASSES})

    def retune(self, config: SchedulerConfig) -> None:
        """New marks from ``config``; each class keeps whether it is shedding (the next sample decides)."""
        for priority, state in self._classes.items():
            state.marks = config.watermarks(priority)

    def update(self, memory_fraction: float, sampled_at: float) -> list[Transition]:
        """Feed one sample; returns the classes whose state changed (usually none)."""
        self.last_fraction = memory_fraction
        changed = []
        for priority, state in self._classes.items():
            if memory_fraction >= state.marks.shed_at:
                state.samples_at_or_above += 1
            else:
                state.samples_at_or_above = 0
            if not state.shedding and memory_fraction >= state.marks.shed_at:
                state.shedding = True
            elif state.shedding and memory_fraction < state.marks.resume_below:
                state.shedding = False
            else:
                continue
            changed.append(Transition(priority, state.shedding, memory_fraction, sampled_at))
        return changed

    def admitting(self, priority: Priority) -> bool:
        state = self._classes.get(priority)
        return state is None or not state.shedding

    def sustained(self, priority: Priority) -> int:
        """How many consecutive samples (ending with the last) were at or above ``shed_at``."""
        state = self._classes.get(priority)
        return 0 if state is None else state.samples_at_or_above


class Projection:
    """Memory admitted since the last sample, projected onto that sample's fraction.

    Samples come every 200 ms; an engine can fill its cache faster. Every admission adds
    its reserved tokens (prompt + ``max_tokens``: an upper bound of what it will hold) with
    its time; a sample taken at ``t`` already shows what was admitted up to ``t``, so only
    later admissions are added. Off when ``capacity_tokens`` is 0.
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._since: collections.deque[tuple[float, int]] = collections.deque()
        self._tokens = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def admitted(self, tokens: int, at: float) -> None:
        if self.enabled and tokens:
            self._since.append((at, tokens))
            self._tokens += tokens

    def sampled(self, sampled_at: float) -> None:
        while self._since and self._since[0][0] <= sampled_at:
            self._tokens -= self._since.popleft()[1]

    def fraction(self, sampled_fraction: float | None) -> float | None:
        if not self.enabled or sampled_fraction is None:
            return sampled_fraction
        return sampled_fraction + self._tokens / self.capacity_tokens


def pressure_from_readings(
    readings: Sequence[GpuReading],
    running: Sequence[RunningStream],
    waiting: int,
    sampled_at: float,
    *,
    kv_cache_usage: float | None = None,
) -> Pressure:
    """One ``Pressure`` from one sample of every GPU the engine uses, or of the engine's KV cache.

    With ``kv_cache_usage`` (the ``kvCache`` signal: the engine's own KV-cache use, 0..1) that is
    the fraction and ``readings`` are not consulted. Otherwise the engine needs all its GPUs
    (tensor parallelism), so the fullest one decides; a sample with no reading (a failed sample)
    is not "0 % memory": it raises ``SchedulerError`` so the caller skips ``observe`` and the
    gate keeps its last state instead of re-opening.
    """
    if kv_cache_usage is not None:
        fraction = min(1.0, max(0.0, float(kv_cache_usage)))
    elif not readings:
        raise SchedulerError("no GPU reading in this sample: keep the last pressure state")
    else:
        fraction = max(r.memory_fraction for r in readings)
    return Pressure(memory_fraction=fraction, running=tuple(running), waiting=waiting, sampled_at=sampled_at)
