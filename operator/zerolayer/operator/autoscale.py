"""The fleet autoscaler: gossiped load in, a replica count out. Pure: no I/O, no clock.

The rule is the Horizontal Pod Autoscaler's, applied to what the runtimes already publish in their
``InferenceNode.status.load`` (no metrics pipeline, no central service):

1. **Recommend.** ``ceil(sum(metric over the fleet's reporting InferenceNodes) / target)``, kept at the
   current count while the load per InferenceNode is within :data:`TOLERANCE` of the target (so noise
   does not move it). An idle fleet (no load at all) recommends 0; recorded demand (requests for the
   fleet's models that runtimes refused because no node served them) recommends at least 1. Clamped
   to ``minReplicas..maxReplicas``.
2. **Stabilise.** Recommendations are remembered as change points (time, replicas). Scaling up goes
   to the *lowest* recommendation of the last ``scaleUpStabilizationSeconds`` (0: at once); scaling
   down goes to the *highest* recommendation of the last ``scaleDownStabilizationSeconds``, so a lull
   shorter than the window removes nothing. Only change points are stored, so the memory (kept in the
   fleet's status) is written when the recommendation changes, not at every look.

Times are Unix seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

# HPA's default: a ratio of load to target within 10 % of 1 keeps the current count.
TOLERANCE = 0.10
METRICS = {"waitingRequests": ("waiting", int), "runningRequests": ("running", int),
           "kvCacheUsage": ("kvCacheUsage", float)}


@dataclasses.dataclass(frozen=True)
class Policy:
    """``spec.autoscaling`` as plain values; defaults are the CRD's."""

    max_replicas: int
    min_replicas: int = 1
    metric: str = "waitingRequests"
    target: float = 4.0
    up_window_s: float = 0.0
    down_window_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= minReplicas ({self.min_replicas}) <= maxReplicas ({self.max_replicas})")
        if self.metric not in METRICS:
            raise ValueError(f"unknown autoscaling metric {self.metric!r} (one of {', '.join(METRICS)})")
        if self.target <= 0:
            raise ValueError("autoscaling.target must be > 0")

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> "Policy":
        return cls(max_replicas=int(autoscaling["maxReplicas"]),
                   min_replicas=int(autoscaling.get("minReplicas", 1)),
                   metric=str(autoscaling.get("metric", "waitingRequests")),
                   target=float(autoscaling.get("target", 4)),
                   up_window_s=float(autoscaling.get("scaleUpStabilizationSeconds", 0)),
                   down_window_s=float(autoscaling.get("scaleDownStabilizationSeconds", 300)))

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclasses.dataclass(frozen=True)
class Point:
    """From ``at`` on (until the next point) the recommendation was ``replicas``."""

    at: float
    replicas: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """``replicas`` to run now; ``recommended`` before stabilisation; ``history`` to remember; ``reason``
    one CamelCase word for the condition."""

    replicas: int
    recommended: int
    history: tuple[Point, ...]
    reason: str


def metric_value(load: Mapping[str, Any] | None, metric: str) -> float:
    """One InferenceNode's value of ``metric`` from its gossiped ``status.load`` (0 when absent)."""
    field, kind = METRICS[metric]
    value = (load or {}).get(field, 0)
    return float(kind(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def recommend(policy: Policy, values: Sequence[float], current: int, demand: int = 0) -> tuple[int, str]:
    """The clamped recommendation and why, from the metric of each reporting InferenceNode.

    ``current``: InferenceNodes the fleet runs now. ``demand``: requests refused for want of a node,
    recorded recently (see :mod:`.fleet_plan`)."""
    total = sum(values)
    if total <= 0:
        if demand > 0:
            return policy.clamp(max(1, current)), "Demand"
        return policy.clamp(0), "Idle"
    if current > 0 and values and abs(total / (policy.target * current) - 1) <= TOLERANCE:
        return policy.clamp(current), "WithinTolerance"
    wanted = math.ceil(total / policy.target - 1e-9)
    return policy.clamp(max(wanted, 1 if demand > 0 else 0)), "Load"


def remember(history: Sequence[Point], recommended: int, now: float, keep_s: float) -> tuple[Point, ...]:
    """``history`` with ``recommended`` noted at ``now`` (only if it changed), forgetting points that
    ended more than ``keep_s`` ago (the point still in force at ``now - keep_s`` is kept)."""
    points = list(history)
    if not points or points[-1].replicas != recommended:
        points.append(Point(now, recommended))
    horizon = now - keep_s
    first = 0
    for i, point in enumerate(points):
        if point.at <= horizon:
            first = i
    return tuple(points[first:])


def _in_window(history: Sequence[Point], now: float, window_s: float) -> list[int]:
    """Recommendations in force at any time during ``[now - window_s, now]``."""
    start = now - window_s
    seen = []
    for i, point in enumerate(history):
        ends = history[i + 1].at if i + 1 < len(history) else math.inf
        if ends > start:
            seen.append(point.replicas)
    return seen


def decide(policy: Policy, values: Sequence[float], current: int, history: Sequence[Point], now: float,
           demand: int = 0) -> Decision:
    """Recommend, remember, stabilise: the replica count to run now (see the module docstring)."""
    recommended, reason = recommend(policy, values, current, demand)
    # No memory yet (a new fleet, or autoscaling just turned on): the current count counts as recommended
    # now, so the first look never scales down before a whole window has passed.
    points = remember(history or (Point(now, current),), recommended, now, max(policy.up_window_s, policy.down_window_s))
    if recommended > current:
        replicas = max(current, min(_in_window(points, now, policy.up_window_s)))
        if replicas == current:
            reason = "ScaleUpStabilizing"
    elif recommended < current:
        replicas = min(current, max(_in_window(points, now, policy.down_window_s)))
        if replicas == current:
            reason = "ScaleDownStabilizing"
    else:
        replicas = current
    # A spec outside the bounds (set by hand, or the bounds changed) is brought inside at once.
    replicas = policy.clamp(replicas)
    return Decision(replicas, recommended, points, reason)


def history_from_status(entries: Sequence[Mapping[str, Any]] | None, parse) -> tuple[Point, ...]:
    """``status.recommendations`` as points; ``parse`` turns an RFC 3339 time into Unix seconds
    (None when it cannot). Malformed entries are skipped: they only shorten the memory."""
    points = []
    for entry in entries or ():
        at = parse(entry.get("time"))
        replicas = entry.get("replicas")
        if at is not None and isinstance(replicas, int) and not isinstance(replicas, bool):
            points.append(Point(at, replicas))
    return tuple(sorted(points, key=lambda p: p.at))
