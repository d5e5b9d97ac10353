"""Scheduler settings and the scheduler's exception family.

Every threshold has a default that matches the design brief (refuse ``low`` above 0.92 of
memory) and is documented in docs/scheduler.md. ``SchedulerConfig.from_mapping`` reads the
same keys from the standalone YAML config or an ``InferenceNode``'s scheduler section.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zerolayer.contract import Priority
# What the pressure gate reads (``pressure_signal``): zerolayer.runtime.gpu.signal says what each means.
from zerolayer.runtime.gpu.signal import AUTO, GPU_MEMORY, KV_CACHE, PRESSURE_SIGNALS  # noqa: F401 (re-exported)


class SchedulerError(Exception):
    """Base of every error raised by the micro-scheduler."""


class SchedulerConfigError(SchedulerError, ValueError):
    """A scheduler setting is missing, of the wrong type or inconsistent with another."""


@dataclasses.dataclass(frozen=True)
class Watermarks:
    """Hysteresis marks for one priority class.

    New streams of the class are refused once a sample reaches ``shed_at`` and admitted
    again only when a sample falls below ``resume_below`` (< ``shed_at``), so a reading
    that wobbles around one mark cannot make admission flap.
    """

    shed_at: float
    resume_below: float


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Micro-scheduler settings; defaults are the documented behaviour.

    Filters run in the order given; the first refusal wins. Plugin type names are those
    registered in :mod:`zerolayer.runtime.scheduler.plugins`.
    """

    filters: tuple[str, ...] = ("permission", "quota", "deadline", "pressure")
    ordering: str = "priority-deadline"
    victims: str = "largest-first"

    # --- pressure (fraction of the engine's KV cache or of GPU memory: ``pressure_signal``)
    pressure_signal: str = AUTO
    low_shed_at: float = 0.92
    low_resume_below: float = 0.88
    normal_shed_at: float = 0.97
    normal_resume_below: float = 0.93
    #: consecutive samples at/above a class's ``shed_at`` before its running streams are
    #: preempted (1 = on the crossing sample itself; 2 = pressure must persist one more sample)
    preempt_after_samples: int = 2
    #: most streams preempted by one ``observe`` call, all classes together
    max_preemptions_per_tick: int = 2
    pressure_retry_after_s: float = 1.0
    #: KV-cache size in tokens that the memory fraction stands for (0 = unknown, feature off).
    #: When set, tokens reserved by admissions after the last sample are added to that
    #: sample's fraction, so a burst between two samples cannot run past the marks unseen.
    kv_capacity_tokens: int = 0
    #: when ``kv_capacity_tokens`` is 0, take the engine's KV-cache size at start (projection on);
    #: False keeps projection off: shedding then reacts to samples only.
    adopt_engine_kv_capacity: bool = True

    # --- quota
    quota_window_s: float = 60.0
    concurrency_retry_after_s: float = 1.0
    #: tenants missing from ``set_tenants`` are admitted without limits when True, refused
    #: with PERMISSION_DENIED when False. Standalone mode without quotas needs True.
    unknown_tenants_allowed: bool = True

    # --- deadline: a request is refused when even its first token cannot arrive in time
    min_first_token_s: float = 0.002
    prefill_tokens_per_s: float = 4000.0
    queue_delay_per_waiting_s: float = 0.0

    # --- ordering (``priority-deadline``): a deadline moves a request ahead of requests of its class
    #: that arrived at most this long before it, never further (docs/security.md, finding 13): a
    #: free TTFT deadline cannot starve other tenants.
    deadline_fairness_s: float = 5.0

    def __post_init__(self) -> None:
        for name, marks in (("low", self.watermarks(Priority.LOW)), ("normal", self.watermarks(Priority.NORMAL))):
            if not 0.0 < marks.resume_below < marks.shed_at <= 1.0:
                raise SchedulerConfigError(
                    f"{name}: need 0 < {name}_resume_below < {name}_shed_at <= 1, got "
                    f"resume_below={marks.resume_below} shed_at={marks.shed_at}"
                )
        if self.normal_shed_at < self.low_shed_at:
            raise SchedulerConfigError(
                f"normal_shed_at ({self.normal_shed_at}) must not be below low_shed_at ({self.low_shed_at}): "
                "normal streams are shed only after low ones"
            )
        if self.pressure_signal not in PRESSURE_SIGNALS:
            raise SchedulerConfigError(
                f"pressure_signal must be one of {', '.join(PRESSURE_SIGNALS)}, got {self.pressure_signal!r}")
        if self.preempt_after_samples < 1:
            raise SchedulerConfigError("preempt_after_samples must be >= 1")
        if self.kv_capacity_tokens < 0:
            raise SchedulerConfigError("kv_capacity_tokens must be >= 0 (0 = no projection between samples)")
        if self.max_preemptions_per_tick < 0:
            raise SchedulerConfigError("max_preemptions_per_tick must be >= 0 (0 disables preemption)")
        for name in ("quota_window_s", "prefill_tokens_per_s", "deadline_fairness_s"):
            if getattr(self, name) <= 0:
                raise SchedulerConfigError(f"{name} must be > 0")
        for name in ("pressure_retry_after_s", "concurrency_retry_after_s", "min_first_token_s",
                     "queue_delay_per_waiting_s"):
            if getattr(self, name) < 0:
                raise SchedulerConfigError(f"{name} must be >= 0")

    def watermarks(self, priority: Priority) -> Watermarks:
        """The hysteresis marks for ``priority``; HIGH is never shed (marks above any reading)."""
        if priority is Priority.LOW:
            return Watermarks(self.low_shed_at, self.low_resume_below)
        if priority is Priority.NORMAL:
            return Watermarks(self.normal_shed_at, self.normal_resume_below)
        return Watermarks(float("inf"), float("inf"))

    def shed_at(self, priority: Priority) -> float:
        """``watermarks(priority).shed_at`` without building the pair (read at every admission)."""
        if priority is Priority.LOW:
            return self.low_shed_at
        if priority is Priority.NORMAL:
            return self.normal_shed_at
        return float("inf")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "SchedulerConfig":
        """Build from a YAML/JSON mapping with the field names above (camelCase accepted).

        Unknown keys are an error, so a typo in a threshold cannot silently keep the default.
        """
        if not data:
            return cls()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            name = _snake(str(key))
            if name not in fields:
                raise SchedulerConfigError(f"unknown scheduler setting {key!r}; known: {', '.join(sorted(fields))}")
            default = getattr(cls, name)
            try:
                if isinstance(default, tuple):
                    value = tuple(str(v) for v in value)
                elif isinstance(default, bool):
                    if not isinstance(value, bool):
                        raise TypeError("expected true or false")
                elif isinstance(default, int):
                    value = int(value)
                elif isinstance(default, float):
                    value = float(value)
                else:
                    value = str(value)
            except (TypeError, ValueError) as exc:
                raise SchedulerConfigError(f"scheduler setting {key!r}: {exc}") from exc
            kwargs[name] = value
        return cls(**kwargs)


def _snake(name: str) -> str:
    out = []
    for ch in name:
        if ch.isupper():
            out.append("_" + ch.lower())
        else:
            out.append(ch)
    return "".join(out).replace("-", "_")
