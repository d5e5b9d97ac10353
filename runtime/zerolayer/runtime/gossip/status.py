"""What a runtime publishes into its ``InferenceNode.status``, and when. Pure: no I/O, no clock.

``GossipSettings`` come from the InferenceNode's spec (``spec.gossip`` and the scheduler's
thresholds). ``GpuAdmission`` decides, with hysteresis, whether each GPU takes new work.
``GossipState.plan`` turns one set of readings and the engine's load into the status body
to merge-patch, or ``None`` when nothing that matters changed and no heartbeat is due;
``GossipState.published`` records what went out. Publishing "at once" means on the first
tick after the sample that changed something, subject to the per-node rate limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from zerolayer.gpumap import utc_now_rfc3339
from zerolayer.runtime.gpu.api import GpuReading
from zerolayer.runtime.gpu.signal import AUTO, KV_CACHE, resolve_pressure_signal

# How far below utilizationThreshold a GPU must fall before it admits again: utilisation is
# noisy and a GPU hovering at the mark would otherwise flap (and spend the patch budget).
UTILIZATION_HYSTERESIS = 0.05


@dataclasses.dataclass(frozen=True)
class GossipSettings:
    """Publication policy; defaults are the CRD's defaults."""

    heartbeat_s: float = 10.0
    stale_after_s: float = 30.0
    max_patches_per_s: float = 2.0
    memory_step: float = 0.05
    memory_threshold: float = 0.92
    resume_threshold: float = 0.88
    utilization_threshold: float = 0.95
    # A changed prefix-cache digest alone goes out at most this often (docs/routing.md: its staleness
    # and its cost to the API server); admission changes still go out at once.
    prefix_digest_s: float = 2.0
    #: spec.scheduler.pressureSignal: what a GPU's admission follows (see :class:`GpuAdmission`)
    pressure_signal: str = AUTO

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.max_patches_per_s <= 0 or self.memory_step <= 0:
            raise ValueError("heartbeat_s, max_patches_per_s and memory_step must be > 0")
        if not 0 < self.resume_threshold < self.memory_threshold <= 1:
            raise ValueError("need 0 < resume_threshold < memory_threshold <= 1")

    @property
    def min_patch_interval_s(self) -> float:
        return 1.0 / self.max_patches_per_s

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> "GossipSettings":
        """Settings from an ``InferenceNode.spec``; absent fields take the CRD defaults."""
        spec = spec or {}
        gossip = spec.get("gossip") or {}
        scheduler = spec.get("scheduler") or {}
        base = cls()

        def pick(section: Mapping[str, Any], key: str, default: float) -> float:
            value = section.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        return cls(
            heartbeat_s=pick(gossip, "heartbeatSeconds", base.heartbeat_s),
            stale_after_s=pick(gossip, "staleAfterSeconds", base.stale_after_s),
            max_patches_per_s=pick(gossip, "maxPatchesPerSecond", base.max_patches_per_s),
            memory_step=pick(gossip, "memoryStep", base.memory_step),
            memory_threshold=pick(scheduler, "memoryThreshold", base.memory_threshold),
            resume_threshold=pick(scheduler, "resumeThreshold", base.resume_threshold),
            utilization_threshold=pick(scheduler, "utilizationThreshold", base.utilization_threshold),
            prefix_digest_s=pick(gossip, "prefixDigestSeconds", base.prefix_digest_s),
            pressure_signal=str(scheduler.get("pressureSignal") or base.pressure_signal),
        )


@dataclasses.dataclass(frozen=True)
class Load:
    """The engine's load as the server sees it; ``draining`` takes the node out of the map."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    draining: bool = False


class GpuAdmission:
    """Per-GPU admitting state with hysteresis.

    A GPU stops admitting on a sample at or above ``memory_threshold`` or above
    ``utilization_threshold``; it admits again on the first sample below ``resume_threshold``
    with utilisation at or below ``utilization_threshold - UTILIZATION_HYSTERESIS``.

    With ``kv_cache_usage`` (the ``kvCache`` pressure signal: an engine such as vLLM that
    pre-allocates its GPU memory and keeps its GPU busy) the engine's KV-cache use stands for
    every GPU's memory and utilisation is not consulted: NVML then reads ~``gpu_memory_utilization``
    and ~100 % whatever the load, so neither says whether the engine can take more work.
    """

    def __init__(self) -> None:
        self._admitting: dict[str, bool] = {}

    def update(self, readings: Sequence[GpuReading], settings: GossipSettings,
               kv_cache_usage: float | None = None) -> dict[str, bool]:
        out = {}
        for r in readings:
            was = self._admitting.get(r.uuid, True)
            memory, util = r.memory_fraction, r.utilization
            if kv_cache_usage is not None:
                memory, util = kv_cache_usage, 0.0
            if was:
                now = memory < settings.memory_threshold and util <= settings.utilization_threshold
            else:
                now = (memory < settings.resume_threshold
                       and util <= settings.utilization_threshold - UTILIZATION_HYSTERESIS)
            out[r.uuid] = now
        self._admitting = out
        return dict(out)


def gpu_status(r: GpuReading, admitting: bool, fragmentation: float | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "uuid": r.uuid, "index": r.index, "name": r.name,
        "memoryUsedBytes": int(r.memory_used_bytes), "memoryTotalBytes": int(r.memory_total_bytes),
        "utilization": round(float(r.utilization), 4), "admitting": admitting,
    }
    if r.power_watts is not None:
        entry["powerWatts"] = round(float(r.power_watts), 1)
    if r.temperature_c is not None:
        entry["temperatureC"] = round(float(r.temperature_c), 1)
    frag = r.fragmentation if r.fragmentation is not None else fragmentation
    if frag is not None:
        entry["fragmentation"] = round(float(frag), 4)
    if r.nvlink_errors is not None:
        entry["nvlinkErrors"] = int(r.nvlink_errors)
    return entry


def build_status(readings: Sequence[GpuReading], gpu_admitting: Mapping[str, bool], load: Load, *,
                 endpoint: str | None, heartbeat: float,
                 fragmentation: Mapping[int, float] | None = None, models: Sequence[str] = (),
                 prefix_cache: Mapping[str, Any] | None = None,
                 demand: Sequence[Mapping[str, Any]] = (),
                 pressure_signal: str | None = None, api_processes: int = 1) -> dict[str, Any]:
    """The ``status`` fields the runtime owns (never ``phase`` or ``conditions``: the operator's).

    ``heartbeat`` is Unix seconds. ``fragmentation`` maps GPU index to the runtime's own measure
    (reserved-but-unallocated / reserved, see docs/defragd.md) for sources that cannot see it.
    ``models``: every name the runtime serves (base models, then LoRA adapters), so clients route
    by model to nodes that really serve it. ``prefix_cache``: the engines' prefix-cache digest
    (:meth:`zerolayer.prefix.ServedPrefixes.status`), published as ``prefixCache``. ``demand``: requests
    refused here for models this node does not serve (:meth:`zerolayer.runtime.serving.demand.DemandLedger.entries`),
    which the operator reads to scale an InferenceFleet from zero. ``pressure_signal`` (``kvCache`` or
    ``gpuMemory``) tells readers what admission follows: under ``kvCache`` they do not apply the
    utilisation threshold (:func:`zerolayer.gpumap.node_from_object`). ``api_processes``: how many API
    processes serve the endpoint (``server.api_processes``), published as ``apiProcesses`` so that a client
    opens that many connections to reach them all (docs/client.md).
    """
    fragmentation = fragmentation or {}
    gpus = [gpu_status(r, gpu_admitting.get(r.uuid, True), fragmentation.get(r.index)) for r in readings]
    used = sum(r.memory_used_bytes for r in readings)
    total = sum(r.memory_total_bytes for r in readings)
    admitting_gpus = sum(1 for g in gpus if g["admitting"])
    admitting = not load.draining and (admitting_gpus > 0 if gpus else True)
    status: dict[str, Any] = {
        "admitting": admitting,
        "lastHeartbeat": utc_now_rfc3339(heartbeat),
        "gpusAdmitting": f"{admitting_gpus}/{len(gpus)}",
        "memoryPercent": max(0, min(100, round(100 * used / total))) if total else 0,
        "load": {"running": int(load.running), "waiting": int(load.waiting),
                 "kvCacheUsage": round(float(load.kv_cache_usage), 4)},
        "gpus": gpus,
        "apiProcesses": int(api_processes),
    }
    if endpoint:
        status["endpoint"] = endpoint
    if models:
        status["models"] = list(models)
    if prefix_cache is not None:
        status["prefixCache"] = dict(prefix_cache)
    if demand:
        status["demand"] = [dict(e) for e in demand]
    if pressure_signal:
        status["pressureSignal"] = pressure_signal
    return status


def new_demand(previous: Sequence[Mapping[str, Any]] | None, current: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether ``current`` names a model ``previous`` did not, or starts a new burst for one (its count
    went down): what must reach the operator at once. A growing count rides the next heartbeat."""
    before = {e.get("model"): e.get("requests", 0) for e in previous or ()}
    return any(e.get("model") not in before or e.get("requests", 0) < before[e.get("model")] for e in current or ())


@dataclasses.dataclass(frozen=True)
class Plan:
    """A status to publish now, and why (``reason`` is a metric label and a log word)."""

    status: dict[str, Any]
    reason: str


def change_reason(previous: Mapping[str, Any] | None, current: Mapping[str, Any],
                  settings: GossipSettings) -> str | None:
    """Why ``current`` must go out at once compared with the last published ``previous``; None if it need not."""
    if previous is None:
        return "first"
    if previous.get("endpoint") != current.get("endpoint"):
        return "endpoint"
    if previous.get("admitting") != current.get("admitting"):
        return "admitting"
    if previous.get("models") != current.get("models"):
        return "models"  # an adapter loaded or unloaded while running: clients route by this list
    if previous.get("apiProcesses") != current.get("apiProcesses"):
        return "api-processes"  # clients size their connections to the node by it
    before = {g["uuid"]: g for g in previous.get("gpus", ())}
    after = {g["uuid"]: g for g in current.get("gpus", ())}
    if before.keys() != after.keys():
        return "gpus"
    if any(before[u]["admitting"] != g["admitting"] for u, g in after.items()):
        return "gpu-threshold"

    def fraction(g: Mapping[str, Any]) -> float:
        return g["memoryUsedBytes"] / g["memoryTotalBytes"] if g["memoryTotalBytes"] else 0.0

    if any(abs(fraction(g) - fraction(before[u])) > settings.memory_step for u, g in after.items()):
        return "memory-step"
    if (previous.get("prefixCache") or {}).get("digest") != (current.get("prefixCache") or {}).get("digest"):
        return "prefix-digest"  # throttled by GossipState.plan to one per prefix_digest_s
    if new_demand(previous.get("demand"), current.get("demand")):
        return "demand"
    return None


class GossipState:
    """The publication decision for one node; the publisher thread drives it.

    ``plan(...)`` at each tick; ``published(plan, now)`` after a successful patch;
    ``failed(now)`` after a failed one (backs off: 0.5 s doubling up to the heartbeat period).
    Times are monotonic seconds except ``wall`` (Unix seconds, for the heartbeat stamp).
    """

    def __init__(self, settings: GossipSettings | None = None, *, endpoint: str | None = None,
                 models: Sequence[str] = (), engine_preallocates: bool = False, api_processes: int = 1) -> None:
        """``engine_preallocates``: the engine takes its GPU memory at start (vLLM), which makes
        ``pressureSignal: auto`` the KV cache (:func:`~zerolayer.runtime.scheduler.pressure.resolve_pressure_signal`).
        ``api_processes``: the node's API processes, published as ``apiProcesses``."""
        self.settings = settings or GossipSettings()
        self.api_processes = api_processes
        self.engine_preallocates = engine_preallocates
        self.endpoint = endpoint
        self.models = tuple(models)
        self.admission = GpuAdmission()
        self.last_status: dict[str, Any] | None = None
        self.last_published_at: float | None = None
        self.last_attempt_at: float | None = None
        self.last_digest_at = float("-inf")
        self.failures = 0

    def _next_allowed(self) -> float:
        if self.last_attempt_at is None:
            return float("-inf")
        spacing = self.settings.min_patch_interval_s
        if self.failures:
            spacing = max(spacing, min(self.settings.heartbeat_s, 0.5 * 2 ** (self.failures - 1)))
        return self.last_attempt_at + spacing

    def plan(self, readings: Sequence[GpuReading], load: Load, now: float, wall: float,
             fragmentation: Mapping[int, float] | None = None,
             prefix_cache: Mapping[str, Any] | None = None,
             demand: Sequence[Mapping[str, Any]] = ()) -> Plan | None:
        try:
            signal = resolve_pressure_signal(self.settings.pressure_signal, self.engine_preallocates)
        except ValueError:
            signal = resolve_pressure_signal(AUTO, self.engine_preallocates)  # a typo is the CRD's to refuse
        admitting = self.admission.update(readings, self.settings,
                                          load.kv_cache_usage if signal == KV_CACHE else None)
        status = build_status(readings, admitting, load, endpoint=self.endpoint, heartbeat=wall,
                              fragmentation=fragmentation, models=self.models, prefix_cache=prefix_cache,
                              demand=demand, pressure_signal=signal, api_processes=self.api_processes)
        reason = change_reason(self.last_status, status, self.settings)
        if reason == "prefix-digest" and now - self.last_digest_at < self.settings.prefix_digest_s:
            reason = None
        if reason is None and self.last_published_at is not None \
                and now - self.last_published_at >= self.settings.heartbeat_s:
            reason = "heartbeat"
        if reason is None or now < self._next_allowed():
            return None
        self.last_attempt_at = now
        return Plan(status, reason)

    def published(self, plan: Plan, now: float) -> None:
        previous = (self.last_status or {}).get("prefixCache") or {}
        if (plan.status.get("prefixCache") or {}).get("digest") != previous.get("digest"):
            self.last_digest_at = now
        self.last_status = plan.status
        self.last_published_at = now
        self.failures = 0

    def failed(self, now: float) -> None:
        self.failures += 1
