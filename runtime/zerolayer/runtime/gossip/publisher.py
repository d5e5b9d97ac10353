"""The gossip publisher: a thread that keeps this node's ``InferenceNode.status`` current.

``GossipPublisher`` takes callables (``readings``, ``load``, optional ``fragmentation``) and
a status sink (:class:`~zerolayer.runtime.gossip.kube.NodeApi`, or :class:`PrintSink` with no
cluster), so it is independent of the server. Each tick (``tick_s``, or at once when
:meth:`GossipPublisher.notify` is called after a fresh sample) it asks
:class:`~zerolayer.runtime.gossip.status.GossipState` whether to publish, and merge-patches
when told to. API failures are counted, logged and retried with backoff; they never stop
the thread. Settings are read from the InferenceNode at start and refreshed from every
patch response (which carries the whole object, spec included), so no extra reads.

:class:`RecordingSource` wraps the server's GPU source so the publisher sees exactly the
samples the micro-scheduler saw (sampling twice would double NVML work and make a
simulated scenario run at twice its speed), and wakes the publisher after each one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import sys
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence, TextIO

from zerolayer.runtime.gpu.api import GpuReading, GpuSource

from .errors import GossipError, KubeApiError
from .status import GossipSettings, GossipState, Load, Plan

log = logging.getLogger(__name__)


class StatusSink(Protocol):
    def get(self, name: str) -> dict[str, Any]: ...
    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]: ...


class PrintSink:
    """A sink for a runtime with no cluster: prints the status it would patch, one JSON line each."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.calls = 0

    def get(self, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": {}}

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        self.calls += 1
        print(json.dumps({"inferenceNode": name, "wouldPatch": {"status": status}}), file=self.stream, flush=True)
        return {"metadata": {"name": name}, "spec": {}, "status": dict(status)}


class RecordingSource:
    """A GPU source that delegates to ``source`` and keeps the last good readings.

    ``seq`` counts successful samples. ``on_sample`` (e.g. ``publisher.notify``) is called
    after each one, in the sampling thread.
    """

    def __init__(self, source: GpuSource, on_sample: Callable[[], None] | None = None) -> None:
        self.source = source
        self.kind = source.kind
        self.on_sample = on_sample
        self.latest: Sequence[GpuReading] | None = None
        self.seq = 0

    def sample(self) -> Sequence[GpuReading]:
        readings = tuple(self.source.sample())
        self.latest = readings
        self.seq += 1
        if self.on_sample is not None:
            self.on_sample()
        return readings

    def close(self) -> None:
        self.source.close()


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    """One publication: when (monotonic), why, what it said, and which sample it carried."""

    at: float
    reason: str
    admitting: bool
    sample_seq: int | None
    ok: bool


class GossipPublisher:
    """Publishes node ``name``'s GPU map until stopped.

    ``readings()`` returns the latest readings (``None`` until the first sample: nothing is
    published before it); ``load()`` the engine's load; ``fragmentation()`` (optional) GPU index
    -> the runtime's fragmentation; ``sample_seq()`` (optional) the sample counter, recorded with
    each patch so tests can tell which sample a publication carried; ``on_spec(spec)`` (optional)
    sees the InferenceNode's spec whenever it is read (at start and in every patch response);
    ``prefix_cache()`` (optional) the engines' prefix-cache digest object (``status.prefixCache``);
    ``demand()`` (optional) requests refused for models not served here (``status.demand``);
    ``served()`` (optional) the names served now, read each tick (LoRA adapters come and go while
    running), else the fixed ``models``; ``engine_preallocates``: the engine holds its GPU memory from start (vLLM), so GPU admission
    follows its KV cache (:class:`~zerolayer.runtime.gossip.status.GpuAdmission`).
    """

    def __init__(self, name: str, sink: StatusSink, *, readings: Callable[[], Sequence[GpuReading] | None],
                 load: Callable[[], Load], endpoint: str | None = None, models: Sequence[str] = (),
                 fragmentation: Callable[[], Mapping[int, float]] | None = None,
                 sample_seq: Callable[[], int] | None = None, settings: GossipSettings | None = None,
                 prefix_cache: Callable[[], Mapping[str, Any] | None] | None = None,
                 demand: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
                 on_spec: Callable[[Mapping[str, Any]], None] | None = None,
                 served: Callable[[], Sequence[str]] | None = None,
                 engine_preallocates: bool = False, api_processes: int = 1,
                 tick_s: float = 0.2, history: int = 1000,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.sink = sink
        self._readings = readings
        self._load = load
        self._fragmentation = fragmentation
        self._sample_seq = sample_seq
        self._prefix_cache = prefix_cache
        self._demand = demand
        self._served = served
        self._fixed_settings = settings is not None
        self._on_spec = on_spec
        self.state = GossipState(settings, endpoint=endpoint, models=models, engine_preallocates=engine_preallocates,
                                 api_processes=api_processes)
        self.tick_s = tick_s
        self._clock = clock
        self._wall = wall
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gossip-{name}", daemon=True)
        self.history: collections.deque[PatchRecord] = collections.deque(maxlen=history)
        self.patches = 0
        self.failures = 0
        self.last_error: GossipError | None = None
        self._settings_loaded = self._fixed_settings

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "GossipPublisher":
        self._thread.start()
        return self

    def notify(self) -> None:
        """A new sample is available: publish now if it matters (thread-safe, never blocks)."""
        self._wake.set()

    def stop(self, *, final: bool = True, timeout: float = 5.0) -> None:
        """Stop the thread; with ``final``, publish ``admitting: false`` once so readers route away now.

        Without ``final`` the node simply stops heart-beating (what a crash looks like).
        """
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if final and self.state.last_status is not None:
            status = dict(self.state.last_status, admitting=False, gpusAdmitting=f"0/{len(self.state.last_status['gpus'])}")
            status["gpus"] = [dict(g, admitting=False) for g in status["gpus"]]
            self._patch(Plan(status, "stopping"), None)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # ------------------------------------------------------------------ one step
    def _load_settings(self) -> None:
        try:
            obj = self.sink.get(self.name)
        except KubeApiError as exc:
            # not retried on its own: every successful patch returns the object and refreshes them
            self.last_error = exc
            log.warning("gossip: cannot read InferenceNode %s (%s); default settings until the first patch",
                        self.name, exc)
            return
        finally:
            self._settings_loaded = True
        self._adopt(obj)

    def _adopt(self, obj: Mapping[str, Any]) -> None:
        if self._on_spec is not None and isinstance(obj.get("spec"), Mapping):
            self._on_spec(obj["spec"])
        if self._fixed_settings:
            return
        try:
            settings = GossipSettings.from_spec(obj.get("spec"))
        except ValueError as exc:
            log.warning("gossip: InferenceNode %s has unusable gossip settings (%s); keeping %s",
                        self.name, exc, self.state.settings)
            return
        self.state.settings = settings

    def _patch(self, plan: Plan, seq: int | None) -> bool:
        now = self._clock()
        try:
            obj = self.sink.patch_status(self.name, plan.status)
        except KubeApiError as exc:
            self.failures += 1
            self.last_error = exc
            self.state.failed(now)
            self.history.append(PatchRecord(now, plan.reason, plan.status["admitting"], seq, False))
            log.warning("gossip: %s (failure %d; retrying with backoff)", exc, self.state.failures)
            return False
        self.patches += 1
        self.state.published(plan, now)
        self.history.append(PatchRecord(now, plan.reason, plan.status["admitting"], seq, True))
        if isinstance(obj, Mapping):
            self._adopt(obj)
        return True

    def step(self) -> Plan | None:
        """One tick: publish if the policy says so. Returns the plan that was attempted, if any."""
        if not self._settings_loaded:
            self._load_settings()
        readings = self._readings()
        if readings is None:
            return None
        seq = self._sample_seq() if self._sample_seq is not None else None
        fragmentation = self._fragmentation() if self._fragmentation is not None else None
        prefix_cache = self._prefix_cache() if self._prefix_cache is not None else None
        demand = self._demand() if self._demand is not None else ()
        if self._served is not None:
            self.state.models = tuple(self._served())
        plan = self.state.plan(readings, self._load(), self._clock(), self._wall(), fragmentation, prefix_cache,
                               demand)
        if plan is not None:
            self._patch(plan, seq)
        return plan

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the step: a sample that lands during it wakes the next one
            try:
                self.step()
            except Exception:  # a bug in a callable must not end gossip: the node would silently go stale
                log.exception("gossip step failed")
            self._wake.wait(self.tick_s)
