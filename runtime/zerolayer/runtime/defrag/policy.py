"""gpu-defragd's decisions, pure: which processes to nudge, which GPUs to reset. No I/O, no clock.

A compute process is **idle** on a GPU while its memory there is below ``idle_memory_fraction``
of the GPU's total; it is **nudged** (SIGUSR1) once it has been idle at every scan for
``idle_s`` seconds, and then again only after another ``idle_s``. Only processes the pod
scope contains are ever nudged; the others are reported as foreign.

A GPU is a **reset candidate** when its fragmentation (docs/defragd.md) is above
``reset_fragmentation``. The decision is ``reset`` only when the InferenceNode allows it
(``spec.defrag.allowReset``) and the node is drained (no running or waiting streams);
otherwise ``refused`` (not allowed) or ``deferred`` (streams in flight, or load unknown).
``dry_run`` changes nothing here: the daemon reports instead of acting.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from zerolayer.runtime.gpu.api import GpuReading


@dataclasses.dataclass(frozen=True)
class DefragPolicy:
    """Defaults are the CRD's (``spec.defrag``)."""

    enabled: bool = True
    interval_s: float = 300.0
    idle_memory_fraction: float = 0.05
    idle_s: float = 1800.0
    reset_fragmentation: float = 0.25
    allow_reset: bool = False
    dry_run: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None, **overrides: Any) -> "DefragPolicy":
        defrag = (spec or {}).get("defrag") or {}
        base = cls()

        def num(key: str, default: float) -> float:
            value = defrag.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        policy = cls(
            enabled=bool(defrag.get("enabled", base.enabled)),
            interval_s=num("intervalSeconds", base.interval_s),
            idle_memory_fraction=num("idleMemoryFraction", base.idle_memory_fraction),
            idle_s=num("idleMinutes", base.idle_s / 60) * 60,
            reset_fragmentation=num("resetFragmentation", base.reset_fragmentation),
            allow_reset=bool(defrag.get("allowReset", base.allow_reset)),
            dry_run=bool(defrag.get("dryRun", base.dry_run)),
        )
        return dataclasses.replace(policy, **{k: v for k, v in overrides.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class Nudge:
    pid: int
    gpu_uuid: str
    gpu_index: int
    memory_fraction: float
    idle_for_s: float


@dataclasses.dataclass(frozen=True)
class ResetDecision:
    gpu_uuid: str
    gpu_index: int
    fragmentation: float
    action: str  # "reset" | "deferred" | "refused"
    why: str


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    nudges: tuple[Nudge, ...]
    foreign: tuple[int, ...]  # idle-looking PIDs outside the pod scope: never touched
    resets: tuple[ResetDecision, ...]
    fragmentation: Mapping[str, float]  # GPU uuid -> fragmentation, where known
    idle: Mapping[str, int]  # GPU uuid -> idle processes in scope


class IdleTracker:
    """Remembers since when each (GPU, PID) has been idle at every scan, and when it was last nudged."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, int], float] = {}
        self._nudged: dict[tuple[str, int], float] = {}

    def observe(self, readings: Sequence[GpuReading], now: float, policy: DefragPolicy,
                in_scope: Callable[[int], bool]) -> tuple[list[Nudge], list[int], dict[str, int]]:
        since: dict[tuple[str, int], float] = {}
        nudges, foreign, idle_count = [], [], {}
        for r in readings:
            idle_count[r.uuid] = 0
            for p in r.processes:
                fraction = p.used_memory_bytes / r.memory_total_bytes if r.memory_total_bytes else 0.0
                if fraction >= policy.idle_memory_fraction:
                    continue
                if not in_scope(p.pid):
                    foreign.append(p.pid)
                    continue
                key = (r.uuid, p.pid)
                since[key] = self._since.get(key, now)
                idle_count[r.uuid] += 1
                idle_for = now - since[key]
                last = self._nudged.get(key)
                if idle_for >= policy.idle_s and (last is None or now - last >= policy.idle_s):
                    nudges.append(Nudge(p.pid, r.uuid, r.index, fraction, idle_for))
        self._since = since  # a process seen busy, or gone, starts over
        self._nudged = {k: v for k, v in self._nudged.items() if k in since}
        return nudges, sorted(set(foreign)), idle_count

    def nudged(self, nudge: Nudge, now: float) -> None:
        self._nudged[(nudge.gpu_uuid, nudge.pid)] = now


def reset_decisions(readings: Sequence[GpuReading], published: Mapping[str, float], policy: DefragPolicy,
                    in_flight: int | None) -> tuple[list[ResetDecision], dict[str, float]]:
    """Reset decisions per GPU; ``published`` is fragmentation by uuid from the node's status."""
    decisions, known = [], {}
    for r in readings:
        frag = r.fragmentation if r.fragmentation is not None else published.get(r.uuid)
        if frag is None:
            continue
        known[r.uuid] = frag
        if frag <= policy.reset_fragmentation:
            continue
        if not policy.allow_reset:
            action, why = "refused", "spec.defrag.allowReset is false"
        elif in_flight is None:
            action, why = "deferred", "the node's load is unknown (no fresh status)"
        elif in_flight > 0:
            action, why = "deferred", f"waiting for the node to drain ({in_flight} streams in flight)"
        else:
            action, why = "reset", "drained"
        decisions.append(ResetDecision(r.uuid, r.index, frag, action, why))
    return decisions, known
