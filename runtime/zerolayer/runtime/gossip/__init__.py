"""GPU-map gossip: the runtime publishes its GPU map and load into its ``InferenceNode.status``.

- :mod:`.status`: what is published and when (pure);
- :mod:`.publisher`: the publishing thread, the recording GPU source, a print sink for no cluster;
- :mod:`.kube`: every Kubernetes call (read the node, merge-patch status, record Events).

Readers use :mod:`zerolayer.gpumap`. See docs/gpu-map.md.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from .errors import GossipError, KubeApiError
from .publisher import GossipPublisher, PatchRecord, PrintSink, RecordingSource, StatusSink
from .status import GossipSettings, GossipState, Load, build_status, change_reason

__all__ = [
    "GossipError", "GossipPublisher", "GossipSettings", "GossipState", "KubeApiError", "Load", "PatchRecord",
    "PrintSink", "RecordingSource", "StatusSink", "build_publisher", "build_status", "change_reason",
]


def build_publisher(name: str, sink: StatusSink, *, engine: Any, draining: Callable[[], bool],
                    recording: RecordingSource | None, tick_s: float, endpoint: str | None = None,
                    on_spec: Any = None,
                    fragmentation: Callable[[], Mapping[int, float]] | None = None,
                    demand: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
                    peer_prefixes: Sequence[Any] = (), api_processes: int = 1) -> GossipPublisher:
    """A publisher (not started) for node ``name``: readings from ``recording`` (the server's GPU
    source, wrapped by whoever built the server), load from ``engine.stats()`` and ``draining()``,
    ``fragmentation()`` (the node agent passes gpu-defragd's CUDA allocator reading,
    :func:`~zerolayer.runtime.defrag.fragmentation.allocator_fragmentation`); the served names
    (``models``, adapters included) from ``engine.models``, read at each tick; the prefix-cache digest from the engines'
    ``served_prefixes`` (:func:`prefix_cache_of`); ``demand()`` the requests refused for models not
    served here (:meth:`zerolayer.runtime.serving.demand.DemandLedger.entries`); ``peer_prefixes`` the other
    API processes' prefix records (:mod:`.prefix_board`) and ``api_processes`` their number (published as
    ``apiProcesses``). The caller wakes it after each
    sample (``publisher.notify``) and sets ``publisher.state.endpoint`` once the port is known.
    """
    def readings():  # type: ignore[no-untyped-def]
        return recording.latest if recording is not None else ()

    def load() -> Load:
        stats = engine.stats()
        return Load(stats.running, stats.waiting, stats.kv_cache_usage, bool(draining()))

    return GossipPublisher(
        name, sink, readings=readings, load=load, endpoint=endpoint, models=tuple(engine.models),
        served=lambda: engine.models,
        fragmentation=fragmentation, sample_seq=(lambda: recording.seq) if recording else None,
        tick_s=tick_s, on_spec=on_spec, prefix_cache=prefix_cache_of(engine, peer_prefixes), demand=demand,
        engine_preallocates=bool(getattr(engine, "preallocates_gpu_memory", False)), api_processes=api_processes,
    )


def prefix_cache_of(engine: Any, peers: Sequence[Any] = ()) -> Callable[[], dict[str, Any] | None] | None:
    """What to publish as ``status.prefixCache``: the union of the engines' records of the prefixes
    they served (:class:`zerolayer.prefix.ServedPrefixes`, an engine's ``served_prefixes``), or None
    when no engine keeps one. A node serving several models publishes one digest for all of them:
    the SDK matches a prompt's blocks and only asks nodes that serve the request's model. ``peers``:
    the other API processes' records (:class:`.prefix_board.PeerRecord`), joined into the same union."""
    from zerolayer.prefix import merged_status

    own = prefix_records(engine)
    if not own:
        return None
    records = [*own, *peers]
    return lambda: merged_status(records)


def prefix_records(engine: Any) -> list[Any]:
    """The engines' records of the prefixes they served (``served_prefixes``), where they keep one."""
    from zerolayer.runtime.engine.router import each_engine

    return [r for e in each_engine(engine) if (r := getattr(e, "served_prefixes", None)) is not None]
