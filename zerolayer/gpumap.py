"""The fleet's GPU map, read from ``InferenceNode`` status: one reader for every consumer.

Each runtime publishes its node's GPU map into ``InferenceNode.status`` (see
``zerolayer.runtime.gossip``). This module is the *reader* shared by the runtimes (alternatives
on a pressure refusal, the map endpoint), the operator (``GossipFresh``), the SDK and
``zerolayer map``. It imports nothing from the runtime, the operator or the client, and
imports the Kubernetes client only when :class:`GpuMapWatcher` is built.

Reading rules (docs/gpu-map.md), applied here so that every reader agrees:

- a node whose ``status.lastHeartbeat`` is older than its ``spec.gossip.staleAfterSeconds``
  (default 30 s), or that never published, is **stale** and does not admit;
- a GPU whose utilisation is above the node's ``spec.scheduler.utilizationThreshold``
  (default 0.95) is taken out of the admitting set, whatever the runtime published, unless the
  node publishes ``pressureSignal: kvCache``: its engine (vLLM) keeps the GPU busy and holds its
  memory from start, so utilisation is no load signal and admission follows the KV cache;
- a node admits when its runtime says so, it is fresh, it has an endpoint and (when it
  reports GPUs) at least one GPU admits.

Consistent hashing (:class:`HashRing`) is the same ring as the SDK's
(``zerolayer.client.nodes.HashRing``: blake2b-64 of ``"<name>#<i>"``, 64 points per node),
so a runtime's suggested alternatives and the SDK's own choice agree for a session.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import hashlib
import json
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from zerolayer.kubewatch import WatchCounters

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "zerolayer.io", "v1alpha1", "inferencenodes", "InferenceNode"
DEFAULT_STALE_AFTER_S = 30.0
DEFAULT_UTILIZATION_THRESHOLD = 0.95
DEFAULT_ALTERNATIVES = 2


class GpuMapError(RuntimeError):
    """The GPU map could not be read (API server unreachable, forbidden, malformed object)."""


# --------------------------------------------------------------------------- time
def utc_now_rfc3339(now: float | None = None) -> str:
    """RFC 3339 UTC with milliseconds (``2026-12-02T11:50:00.123Z``): the heartbeat format."""
    moment = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_rfc3339(value: object) -> float | None:
    """Unix seconds from an RFC 3339 string; ``None`` when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


# --------------------------------------------------------------------------- plain data
@dataclasses.dataclass(frozen=True)
class GpuEntry:
    """One GPU as published, plus the reader's verdict ``admitting``."""

    uuid: str
    index: int
    name: str = ""
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    utilization: float | None = None
    power_watts: float | None = None
    temperature_c: float | None = None
    fragmentation: float | None = None
    nvlink_errors: int | None = None
    published_admitting: bool = True
    admitting: bool = True  # published_admitting and utilisation within the node's threshold

    @property
    def memory_fraction(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """One InferenceNode as every reader sees it.

    ``admitting`` is the reader's verdict (see the module rules); ``reason`` says why not.
    ``heartbeat`` is Unix seconds (``None``: never published); ``age_s`` its age when read.
    """

    name: str
    node_name: str
    endpoint: str | None
    admitting: bool
    reason: str
    published_admitting: bool
    stale: bool
    heartbeat: float | None
    age_s: float | None
    stale_after_s: float
    utilization_threshold: float
    gpus: tuple[GpuEntry, ...] = ()
    memory_percent: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_cache: Mapping[str, Any] | None = None  # status.prefixCache as published (docs/routing.md)
    pressure_signal: str | None = None  # status.pressureSignal: kvCache | gpuMemory (None: not published)
    api_processes: int | None = None  # status.apiProcesses: processes serving the endpoint (None: not published)

    @property
    def prefix_blocks(self) -> int | None:
        return _int((self.prefix_cache or {}).get("blocks"))

    @property
    def prefix_hit_rate(self) -> float | None:
        return _num((self.prefix_cache or {}).get("hitRate"))

    @property
    def gpus_admitting(self) -> str:
        return f"{sum(g.admitting for g in self.gpus)}/{len(self.gpus)}"

    def record(self) -> dict[str, Any]:
        """A flat JSON-able record (the map endpoint's ``nodes[]``; the SDK's HttpNodeMap reads it)."""
        return {
            "name": self.name, "nodeName": self.node_name, "endpoint": self.endpoint,
            "admitting": self.admitting, "reason": self.reason, "stale": self.stale,
            "lastHeartbeat": utc_now_rfc3339(self.heartbeat) if self.heartbeat is not None else None,
            "ageSeconds": None if self.age_s is None else round(self.age_s, 3),
            "gpusAdmitting": self.gpus_admitting, "memoryPercent": self.memory_percent,
            "load": {"running": self.running, "waiting": self.waiting, "kvCacheUsage": self.kv_cache_usage},
            **({"prefixCache": dict(self.prefix_cache)} if self.prefix_cache is not None else {}),
            **({"apiProcesses": self.api_processes} if self.api_processes is not None else {}),
            "gpus": [{
                "uuid": g.uuid, "index": g.index, "name": g.name, "memoryUsedBytes": g.memory_used_bytes,
                "memoryTotalBytes": g.memory_total_bytes, "utilization": g.utilization,
                "powerWatts": g.power_watts, "temperatureC": g.temperature_c, "fragmentation": g.fragmentation,
                "nvlinkErrors": g.nvlink_errors, "admitting": g.admitting,
            } for g in self.gpus],
        }


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: object) -> int | None:
    number = _num(value)
    return None if number is None else int(number)


def _gpu_entry(raw: Mapping[str, Any], utilization_threshold: float) -> GpuEntry:
    utilization = _num(raw.get("utilization"))
    published = raw.get("admitting") is not False
    return GpuEntry(
        uuid=str(raw.get("uuid", "")), index=_int(raw.get("index")) or 0, name=str(raw.get("name", "")),
        memory_used_bytes=_int(raw.get("memoryUsedBytes")) or 0,
        memory_total_bytes=_int(raw.get("memoryTotalBytes")) or 0,
        utilization=utilization, power_watts=_num(raw.get("powerWatts")),
        temperature_c=_num(raw.get("temperatureC")), fragmentation=_num(raw.get("fragmentation")),
        nvlink_errors=_int(raw.get("nvlinkErrors")), published_admitting=published,
        admitting=published and (utilization is None or utilization <= utilization_threshold),
    )


def node_from_object(obj: Mapping[str, Any], now: float | None = None) -> NodeEntry:
    """Read one ``InferenceNode`` object (a dict as the API returns it) at Unix time ``now``."""
    now = time.time() if now is None else now
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    gossip = spec.get("gossip") or {}
    stale_after = _num(gossip.get("staleAfterSeconds")) or DEFAULT_STALE_AFTER_S
    threshold = _num((spec.get("scheduler") or {}).get("utilizationThreshold")) or DEFAULT_UTILIZATION_THRESHOLD
    signal = status.get("pressureSignal") if isinstance(status.get("pressureSignal"), str) else None
    # Under kvCache the runtime's per-GPU verdict already follows the engine's KV cache; utilisation
    # (~100 % on a busy vLLM GPU) would take every serving GPU out of the map.
    gpu_threshold = float("inf") if signal == "kvCache" else threshold
    gpus = tuple(_gpu_entry(g, gpu_threshold) for g in status.get("gpus") or () if isinstance(g, Mapping))
    heartbeat = parse_rfc3339(status.get("lastHeartbeat"))
    age = None if heartbeat is None else max(0.0, now - heartbeat)
    stale = age is None or age > stale_after
    published = status.get("admitting") is True
    endpoint = status.get("endpoint") or None
    if heartbeat is None:
        reason = "never published"
    elif stale:
        reason = f"stale: heartbeat {age:.1f}s old > {stale_after:g}s"
    elif not endpoint:
        reason = "no endpoint"
    elif not published:
        reason = "runtime not admitting"
    elif gpus and not any(g.admitting for g in gpus):
        reason = "no GPU admitting"
    else:
        reason = ""
    load = status.get("load") or {}
    return NodeEntry(
        name=str(metadata.get("name", "")), node_name=str(spec.get("nodeName", "")), endpoint=endpoint,
        admitting=not reason, reason=reason, published_admitting=published, stale=stale, heartbeat=heartbeat,
        age_s=age, stale_after_s=stale_after, utilization_threshold=threshold, gpus=gpus,
        memory_percent=_int(status.get("memoryPercent")), running=_int(load.get("running")),
        waiting=_int(load.get("waiting")), kv_cache_usage=_num(load.get("kvCacheUsage")),
        prefix_cache=status["prefixCache"] if isinstance(status.get("prefixCache"), Mapping) else None,
        pressure_signal=signal, api_processes=_int(status.get("apiProcesses")),
    )


# --------------------------------------------------------------------------- consistent hashing
def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with ``vnodes`` points per node name (same ring as the SDK's)."""

    def __init__(self, names: Iterable[str], vnodes: int = 64) -> None:
        points = sorted((_hash(f"{name}#{i}"), name) for name in set(names) for i in range(vnodes))
        self._keys = [p[0] for p in points]
        self._names = [p[1] for p in points]

    def walk(self, key: str) -> Iterator[str]:
        """Distinct node names in ring order from ``key``'s position: the owner first."""
        if not self._keys:
            return
        start = bisect.bisect(self._keys, _hash(key))
        seen: set[str] = set()
        for i in range(len(self._keys)):
            name = self._names[(start + i) % len(self._keys)]
            if name not in seen:
                seen.add(name)
                yield name


@dataclasses.dataclass(frozen=True)
class FleetMap:
    """A snapshot of every InferenceNode, read at ``read_at`` (Unix seconds). Plain data."""

    nodes: tuple[NodeEntry, ...]
    read_at: float

    @classmethod
    def from_objects(cls, objects: Iterable[Mapping[str, Any]], now: float | None = None) -> "FleetMap":
        now = time.time() if now is None else now
        return cls(tuple(sorted((node_from_object(o, now) for o in objects), key=lambda n: n.name)), now)

    def node(self, name: str) -> NodeEntry | None:
        return next((n for n in self.nodes if n.name == name), None)

    def admitting(self) -> tuple[NodeEntry, ...]:
        return tuple(n for n in self.nodes if n.admitting)

    def choose(self, session: str | None, *, exclude: Iterable[str] = (), limit: int = 1) -> list[NodeEntry]:
        """Admitting nodes for ``session`` in consistent-hash order, owner first, without ``exclude``.

        Without a session every request hashes to the same place; callers that want spreading
        pass a request id instead.
        """
        skip = set(exclude)
        candidates = {n.name: n for n in self.admitting() if n.name not in skip and n.endpoint}
        out = []
        for name in HashRing(candidates).walk(session or ""):
            out.append(candidates[name])
            if len(out) >= limit:
                break
        return out

    def to_document(self) -> dict[str, Any]:
        """The map endpoint's JSON document: ``{"readAt": ..., "nodes": [record, ...]}``."""
        return {"readAt": utc_now_rfc3339(self.read_at), "nodes": [n.record() for n in self.nodes]}


# --------------------------------------------------------------------------- runtime-facing helpers
def alternatives_header(fleet: FleetMap | None, session: str | None, *, self_name: str | None = None,
                        limit: int = DEFAULT_ALTERNATIVES) -> str | None:
    """The value of ``contract.ALTERNATIVES`` for a pressure refusal, or ``None`` if no node admits.

    Endpoints of up to ``limit`` admitting nodes other than ``self_name``, in the session's
    consistent-hash order, comma-separated: a client that follows the first one lands where its
    own ring would send it once this node is out of the admitting set.
    """
    if fleet is None:
        return None
    chosen = fleet.choose(session, exclude=[self_name] if self_name else (), limit=limit)
    return ",".join(str(n.endpoint) for n in chosen) or None


def render_map_document(fleet: FleetMap | None) -> bytes:
    """Body of ``GET /v1/zerolayer/map`` (``application/json``) for clients without Kubernetes credentials."""
    document = fleet.to_document() if fleet is not None else {"readAt": utc_now_rfc3339(), "nodes": []}
    return json.dumps(document, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- the watcher
def load_custom_objects_api(kubeconfig: str | None = None) -> Any:
    """A ``CustomObjectsApi`` from ``kubeconfig``, else in-cluster config, else the default kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError as exc:  # pragma: no cover - kubernetes is a core dependency
        raise GpuMapError("reading the GPU map needs the kubernetes package") from exc
    from zerolayer import kubeaccess

    try:
        api_client = kubeaccess.api_client(kubeconfig)
    except kubeaccess.KubeConfigError as exc:
        raise GpuMapError(f"no Kubernetes configuration for the GPU map: {exc}") from exc
    return client.CustomObjectsApi(api_client)


class GpuMapWatcher:
    """Lists and watches ``InferenceNode`` objects in a daemon thread; :meth:`snapshot` never blocks.

    Built on :class:`zerolayer.kubewatch.WatchLoop`: one LIST, then one watch resumed from its last
    resourceVersion whenever the server ends it (every ``watch_timeout_s``); LIST again only after
    410 Gone. After a failure it tries again ``retry_s`` later; the last objects are kept
    meanwhile, so nodes go stale by their own heartbeats rather than vanishing. ``label_selector``
    narrows what is watched to the nodes a reader needs (a runtime passes its pool's label when
    the fleet is split into pools; default: every node). ``on_change`` (optional) is called in the
    watcher thread after every event. The snapshot is recomputed at the time it is asked for, so a
    node ages into staleness with no event at all.
    """

    def __init__(self, api: Any = None, *, kubeconfig: str | None = None, retry_s: float = 2.0,
                 watch_timeout_s: int = 300, on_change: Callable[[], None] | None = None,
                 label_selector: str | None = None, on_demand_idle_s: float | None = None) -> None:
        """``on_demand_idle_s``: watch only while the map is used. :meth:`start` then opens nothing;
        the first :meth:`snapshot` opens the watch (that snapshot and those until the first listing
        arrives are empty), and the watch is closed again once no snapshot was asked for during
        ``on_demand_idle_s``. A runtime needs the map only to name alternatives when it refuses for
        pressure and to answer the map endpoint: an idle or unpressured node then receives no
        heartbeat events at all. None: watch from :meth:`start` to :meth:`stop`."""
        self._api = api if api is not None else load_custom_objects_api(kubeconfig)
        self._on_change = on_change
        self._label_selector, self._retry_s, self._watch_timeout_s = label_selector, retry_s, watch_timeout_s
        self._on_demand_idle_s = on_demand_idle_s
        self._guard = threading.Lock()
        self._last_used = 0.0
        self._reaper: threading.Thread | None = None
        self._stopped = threading.Event()
        self._retired = WatchCounters()
        self._loop = self._new_loop()

    def _new_loop(self) -> Any:
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._api.list_cluster_custom_object, GROUP, VERSION, PLURAL, name="gpumap",
                         on_change=self._changed, label_selector=self._label_selector,
                         retry_s=self._retry_s, watch_timeout_s=self._watch_timeout_s)

    @property
    def counters(self) -> Any:
        """LIST/WATCH requests and events so far, over every watch opened (:class:`zerolayer.kubewatch.WatchCounters`)."""
        now = self._loop.counters
        return WatchCounters(*(getattr(self._retired, f) + getattr(now, f) for f in WatchCounters.__dataclass_fields__))

    @property
    def events(self) -> int:
        return self.counters.events

    @property
    def watching(self) -> bool:
        return self._loop._thread.is_alive()

    @property
    def last_error(self) -> GpuMapError | None:
        error = self._loop.last_error
        return GpuMapError(f"InferenceNode watch failed: {error}") if error else None

    def start(self) -> "GpuMapWatcher":
        if self._on_demand_idle_s is None:
            self._loop.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        with self._guard:
            self._loop.stop(timeout)
        if self._reaper is not None and threading.current_thread() is not self._reaper:
            self._reaper.join(timeout)

    def __enter__(self) -> "GpuMapWatcher":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the first listing arrived (start-up only; not on an event loop)."""
        self._used()
        return self._loop.started.wait(timeout)

    def snapshot(self, now: float | None = None) -> FleetMap:
        self._used()
        return FleetMap.from_objects(list(self._loop.objects.values()), now)

    def _used(self) -> None:
        if self._on_demand_idle_s is None or self._stopped.is_set():
            return
        self._last_used = time.monotonic()
        if self.watching:
            return
        with self._guard:
            if self.watching or self._stopped.is_set():
                return
            if self._loop.counters.watches or self._loop.counters.lists:  # a closed one: threads start once
                self._retire()
                self._loop = self._new_loop()
            self._loop.start()
            self._reaper = threading.Thread(target=self._reap, name="gpumap-idle", daemon=True)
            self._reaper.start()

    def _retire(self) -> None:
        for f in WatchCounters.__dataclass_fields__:
            setattr(self._retired, f, getattr(self._retired, f) + getattr(self._loop.counters, f))

    def _reap(self) -> None:
        """Close the watch once the map went unused for ``on_demand_idle_s``."""
        assert self._on_demand_idle_s is not None
        while not self._stopped.wait(max(0.05, self._last_used + self._on_demand_idle_s - time.monotonic())):
            if time.monotonic() - self._last_used >= self._on_demand_idle_s:
                with self._guard:
                    self._loop.stop()
                log.info("GPU map unused for %gs: watch closed until it is needed", self._on_demand_idle_s)
                return

    def wait_for(self, predicate: Callable[[FleetMap], bool], timeout: float) -> FleetMap:
        """Block until ``predicate(snapshot)`` holds; raises :class:`GpuMapError` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            fleet = self.snapshot()
            if predicate(fleet):
                return fleet
            if time.monotonic() >= deadline:
                raise GpuMapError(f"GPU map did not reach the expected state within {timeout}s")
            time.sleep(0.05)

    def _changed(self) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change()
        except Exception:  # a consumer's bug must not end the watch (the map would freeze)
            log.exception("GPU map on_change callback failed")

    def list_once(self) -> str | None:
        """Relist every InferenceNode; returns the list's resourceVersion."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return self._loop.list_once()
        except (ApiException, HTTPError, OSError) as exc:
            raise GpuMapError(f"cannot list InferenceNodes: {exc}") from exc
