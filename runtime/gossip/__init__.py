"""GPU-map gossip: the runtime publishes its GPU map and load into its ``InferenceNode.status``.

- :mod:`.status`: what is published and when (pure);
- :mod:`.publisher`: the publishing thread, the recording GPU source, a print sink for no cluster;
- :mod:`.kube`: every Kubernetes call (read the node, merge-patch status, record Events).

Readers use :mod:`zerolayer.gpumap`. See docs/gpu-map.md.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import GossipError, KubeApiError
from .publisher import GossipPublisher, PatchRecord, PrintSink, RecordingSource, StatusSink
from .status import GossipSettings, GossipState, Load, build_status, change_reason

__all__ = [
    "GossipError", "GossipPublisher", "GossipSettings", "GossipState", "KubeApiError", "Load", "PatchRecord",
    "PrintSink", "RecordingSource", "StatusSink", "build_publisher", "build_status", "change_reason",
]


def build_publisher(name: str, sink: StatusSink, *, engine: Any, draining: Callable[[], bool],
                    recording: RecordingSource | None, tick_s: float, endpoint: str | None = None,
                    on_spec: Any = None) -> GossipPublisher:
    """A publisher (not started) for node ``name``: readings from ``recording`` (the server's GPU
    source, wrapped by whoever built the server), load from ``engine.stats()`` and ``draining()``,
    fragmentation from the CUDA allocator when torch uses a GPU; the served names (``models``,
    adapters included) from ``engine.models``. The caller wakes it after each
    sample (``publisher.notify``) and sets ``publisher.state.endpoint`` once the port is known.
    """
    from zerolayer.runtime.defrag.fragmentation import allocator_fragmentation

    def readings():  # type: ignore[no-untyped-def]
        return recording.latest if recording is not None else ()

    def load() -> Load:
        stats = engine.stats()
        return Load(stats.running, stats.waiting, stats.kv_cache_usage, bool(draining()))

    return GossipPublisher(
        name, sink, readings=readings, load=load, endpoint=endpoint, models=tuple(engine.models),
        fragmentation=allocator_fragmentation, sample_seq=(lambda: recording.seq) if recording else None,
        tick_s=tick_s, on_spec=on_spec,
    )
