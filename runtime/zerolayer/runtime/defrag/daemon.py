"""gpu-defragd: scan GPU compute processes, nudge idle ones in our pod, reset fragmented GPUs if allowed.

:class:`Defragd.scan_once` is one scan: read the GPU source, read the InferenceNode (policy
from ``spec.defrag``, published fragmentation and load from ``status``), decide
(:mod:`.policy`), act, and report every action as an Event (:class:`EventSink`) and a
metric (:class:`DefragMetrics`). In dry-run mode the same Events and metrics say what
*would* have been done (action label ``mode="dry_run"``) and nothing is signalled or reset.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from zerolayer.gpumap import node_from_object
from zerolayer.runtime.gpu.api import GpuSource, GpuSourceError

from .errors import DefragError
from .policy import DefragPolicy, IdleTracker, Nudge, ResetDecision, reset_decisions
from .scope import PodScope, catches_signal

log = logging.getLogger(__name__)


class EventSink(Protocol):
    def event(self, reason: str, message: str, *, action: str, type_: str = "Normal") -> None: ...


class LogEvents:
    """Events for a defragd with no cluster: the log is the record."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, str, str, str]] = []

    def event(self, reason: str, message: str, *, action: str, type_: str = "Normal") -> None:
        self.recorded.append((reason, message, action, type_))
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s: %s", reason, message)


class KubeEvents:
    """Events on the InferenceNode through :class:`~zerolayer.runtime.gossip.kube.NodeApi`.

    A failed Event is logged, not raised: the action it reports already happened.
    """

    def __init__(self, api: Any, node: Callable[[], Mapping[str, Any] | None]) -> None:
        self.api = api
        self._node = node
        self.failures = 0

    def event(self, reason: str, message: str, *, action: str, type_: str = "Normal") -> None:
        from zerolayer.runtime.gossip.errors import KubeApiError

        node = self._node()
        if node is None:
            log.warning("%s (no InferenceNode to attach the Event to): %s", reason, message)
            return
        try:
            self.api.create_event(node, reason=reason, message=message, action=action, type_=type_)
        except KubeApiError as exc:
            self.failures += 1
            log.warning("cannot record Event %s (%s): %s", reason, exc, message)


class DefragMetrics:
    """Prometheus metrics of one defragd (own registry: several may live in one test process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.scans = Counter("zerolayer_defrag_scans_total", "GPU process scans", registry=self.registry)
        self.actions = Counter("zerolayer_defrag_actions_total", "Actions taken or, in dry-run, that would be",
                               ["action", "mode", "result"], registry=self.registry)
        self.foreign = Counter("zerolayer_defrag_foreign_processes_total",
                               "Idle GPU processes outside this pod, left alone", registry=self.registry)
        self.fragmentation = Gauge("zerolayer_gpu_fragmentation_ratio",
                                   "(reserved - allocated) / reserved of the GPU's caching allocator",
                                   ["gpu", "index"], registry=self.registry)
        self.idle = Gauge("zerolayer_defrag_idle_processes", "Idle compute processes in this pod per GPU",
                          ["gpu"], registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def nvidia_smi_reset(gpu_index: int) -> None:
    """Reset one GPU with ``nvidia-smi --gpu-reset`` (needs root and no process left on the GPU)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--gpu-reset", "-i", str(gpu_index)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DefragError(f"cannot run nvidia-smi to reset GPU {gpu_index}: {exc}") from exc
    if proc.returncode != 0:
        raise DefragError(f"nvidia-smi could not reset GPU {gpu_index}: {(proc.stderr or proc.stdout).strip()}")


@dataclasses.dataclass(frozen=True)
class ScanReport:
    nudged: tuple[Nudge, ...]
    would_nudge: tuple[Nudge, ...]  # dry run
    foreign: tuple[int, ...]
    resets: tuple[ResetDecision, ...]
    fragmentation: Mapping[str, float]
    error: str | None = None


def _published(node: Mapping[str, Any] | None, now: float | None = None) -> tuple[dict[str, float], int | None]:
    """(fragmentation by uuid, in-flight streams or None) from an InferenceNode's status at Unix time
    ``now``. A stale heartbeat (older than the node's ``staleAfterSeconds``, as every reader of the
    GPU map judges it) makes the load unknown: "drained" must never rest on an old count."""
    status = (node or {}).get("status") or {}
    frag = {str(g.get("uuid")): float(g["fragmentation"]) for g in status.get("gpus") or ()
            if isinstance(g, Mapping) and isinstance(g.get("fragmentation"), (int, float))}
    load = status.get("load")
    in_flight = None
    if isinstance(load, Mapping) and isinstance(load.get("running"), int) and isinstance(load.get("waiting"), int):
        in_flight = load["running"] + load["waiting"]
    if in_flight is not None and node_from_object(node or {}, now).stale:
        in_flight = None
    return frag, in_flight


class Defragd:
    """One node's defragmenter. ``node()`` returns the InferenceNode dict (or ``None`` without a cluster)."""

    def __init__(self, source: GpuSource, scope: PodScope, *, policy: DefragPolicy | None = None,
                 node: Callable[[], Mapping[str, Any] | None] = lambda: None,
                 policy_overrides: Mapping[str, Any] | None = None, events: EventSink | None = None,
                 metrics: DefragMetrics | None = None, send_signal: Callable[[int, int], None] = os.kill,
                 reset: Callable[[int], None] = nvidia_smi_reset, clock: Callable[[], float] = time.monotonic,
                 catches: Callable[[int, int], bool] = catches_signal,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.scope = scope
        self._overrides = dict(policy_overrides or {})
        self.policy = policy or DefragPolicy.from_spec(None, **self._overrides)
        self._fixed_policy = policy is not None
        self._node = node
        self.events = events or LogEvents()
        self.metrics = metrics or DefragMetrics()
        self._send_signal = send_signal
        self._reset = reset
        self._clock = clock
        self._catches = catches
        self._wall_clock = wall_clock  # for the status heartbeat's age (Unix time)
        self.tracker = IdleTracker()
        self._stop = threading.Event()

    def _mode(self) -> str:
        return "dry_run" if self.policy.dry_run else "live"

    def _count(self, action: str, result: str) -> None:
        self.metrics.actions.labels(action=action, mode=self._mode(), result=result).inc()

    def scan_once(self) -> ScanReport:
        node = self._node()
        if node is not None and not self._fixed_policy:
            self.policy = DefragPolicy.from_spec(node.get("spec"), **self._overrides)
        self.metrics.scans.inc()
        try:
            readings: Sequence[Any] = tuple(self.source.sample())
        except GpuSourceError as exc:
            log.warning("defragd: GPU scan failed: %s", exc)
            return ScanReport((), (), (), (), {}, str(exc))
        now = self._clock()
        nudges, foreign, idle = self.tracker.observe(readings, now, self.policy, self.scope.contains)
        published, in_flight = _published(node, self._wall_clock())
        resets, fragmentation = reset_decisions(readings, published, self.policy, in_flight)
        for r in readings:
            if r.uuid in fragmentation:
                self.metrics.fragmentation.labels(gpu=r.uuid, index=str(r.index)).set(fragmentation[r.uuid])
            self.metrics.idle.labels(gpu=r.uuid).set(idle.get(r.uuid, 0))
        if foreign:
            self.metrics.foreign.inc(len(foreign))
            log.debug("defragd: idle PIDs outside %s left alone: %s", self.scope.describe(), foreign)
        nudged: list[Nudge] = []
        would: list[Nudge] = []
        for n in nudges:
            if self._nudge(n, now):
                (would if self.policy.dry_run else nudged).append(n)
        for decision in resets:
            self._act_on_reset(decision)
        return ScanReport(tuple(nudged), tuple(would), tuple(foreign), tuple(resets), fragmentation)

    def _nudge(self, n: Nudge, now: float) -> bool:
        what = (f"PID {n.pid} on GPU {n.gpu_index} ({n.gpu_uuid}) used {n.memory_fraction:.1%} of its memory "
                f"for {n.idle_for_s / 60:.0f} min")
        if not self.policy.dry_run and not self.scope.contains(n.pid):
            self._count("nudge", "skipped")  # asked again: the PID may have exited and been reused
            return False
        dry = "dry run: " if self.policy.dry_run else ""
        if not self._catches(n.pid, signal.SIGUSR1):
            # SIGUSR1's default action is to terminate: a process that does not catch it would be killed,
            # not nudged. Remembered as nudged so the Event comes once per idle period, not every scan.
            self.tracker.nudged(n, now)
            self._count("nudge", "no_handler")
            self.events.event("IdleProcessNotNudged", f"{dry}not signalling {what}: it has no SIGUSR1 handler "
                              "(SigCgt), so the signal would terminate it", action="Nudge")
            return False
        if self.policy.dry_run:
            self.tracker.nudged(n, now)
            self._count("nudge", "ok")
            self.events.event("IdleProcessNudge", f"dry run: would send SIGUSR1 to {what}", action="Nudge")
            return True
        try:
            self._send_signal(n.pid, signal.SIGUSR1)
        except OSError as exc:
            self._count("nudge", "failed")
            self.events.event("IdleProcessNudgeFailed", f"SIGUSR1 to {what} failed: {exc}", action="Nudge",
                              type_="Warning")
            return False
        self.tracker.nudged(n, now)
        self._count("nudge", "ok")
        self.events.event("IdleProcessNudged", f"sent SIGUSR1 to {what}", action="Nudge")
        return True

    def _act_on_reset(self, d: ResetDecision) -> None:
        what = f"GPU {d.gpu_index} ({d.gpu_uuid}) fragmentation {d.fragmentation:.0%} > " \
               f"{self.policy.reset_fragmentation:.0%}"
        if d.action == "refused":
            self._count("reset_refused", "ok")
            self.events.event("GpuResetNotAllowed", f"{what}; not resetting: {d.why}", action="Reset")
        elif d.action == "deferred":
            self._count("reset_deferred", "ok")
            self.events.event("GpuResetDeferred", f"{what}; {d.why}", action="Reset")
        elif self.policy.dry_run:
            self._count("reset", "ok")
            self.events.event("GpuReset", f"dry run: would reset {what}", action="Reset")
        else:
            try:
                self._reset(d.gpu_index)
            except DefragError as exc:
                self._count("reset", "failed")
                self.events.event("GpuResetFailed", f"{what}: {exc}", action="Reset", type_="Warning")
                return
            self._count("reset", "ok")
            self.events.event("GpuReset", f"reset {what} (node drained)", action="Reset")

    def run(self, *, once: bool = False) -> None:
        """Scan every ``policy.interval_s`` until :meth:`stop` (blocking: run it in its own thread or process)."""
        while not self._stop.is_set():
            if self.policy.enabled:
                self.scan_once()
            else:  # disabled in spec: keep reading it so that re-enabling takes effect
                node = self._node()
                if node is not None and not self._fixed_policy:
                    self.policy = DefragPolicy.from_spec(node.get("spec"), **self._overrides)
            if once:
                return
            self._stop.wait(self.policy.interval_s)

    def stop(self) -> None:
        self._stop.set()
