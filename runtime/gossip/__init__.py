"""GPU-map gossip: the runtime publishes its GPU map and load into its ``InferenceNode.status``.

- :mod:`.status`: what is published and when (pure);
- :mod:`.publisher`: the publishing thread, the recording GPU source, a print sink for no cluster;
- :mod:`.kube`: every Kubernetes call (read the node, merge-patch status, record Events).

Readers use :mod:`zerolayer.gpumap`. See docs/gpu-map.md.
"""

from __future__ import annotations

from typing import Any

from .errors import GossipError, KubeApiError
from .publisher import GossipPublisher, PatchRecord, PrintSink, RecordingSource, StatusSink
from .status import GossipSettings, GossipState, Load, build_status, change_reason

__all__ = [
    "GossipError", "GossipPublisher", "GossipSettings", "GossipState", "KubeApiError", "Load", "PatchRecord",
    "PrintSink", "RecordingSource", "StatusSink", "attach_to_server", "build_status", "change_reason",
    "recording_source",
]


def recording_source(server: Any) -> RecordingSource | None:
    """``server.gpu_source`` wrapped (once) in a :class:`RecordingSource`; ``None`` without a GPU source."""
    if server.gpu_source is None or isinstance(server.gpu_source, RecordingSource):
        return server.gpu_source
    server.gpu_source = RecordingSource(server.gpu_source)
    return server.gpu_source


def attach_to_server(server: Any, name: str, sink: StatusSink, *, endpoint: str | None = None,
                     on_spec: Any = None) -> GossipPublisher:
    """Build (not start) a publisher for a ``RuntimeServer`` (before or after ``server.start()``).

    Wraps ``server.gpu_source`` in a :class:`RecordingSource` so the publisher sees the samples
    the micro-scheduler takes and is woken after each; load comes from ``server.engine.stats()``
    and ``server.draining``; fragmentation from the CUDA allocator when torch uses a GPU.
    The server's port is known only after ``server.start()``: set ``publisher.state.endpoint``
    then (unless ``endpoint`` was given), and start the publisher.
    """
    from zerolayer.runtime.defrag.fragmentation import allocator_fragmentation

    publisher: GossipPublisher
    recording = recording_source(server)

    def readings():  # type: ignore[no-untyped-def]
        return recording.latest if recording is not None else ()

    def load() -> Load:
        stats = server.engine.stats()
        return Load(stats.running, stats.waiting, stats.kv_cache_usage, bool(server.draining))

    publisher = GossipPublisher(
        name, sink, readings=readings, load=load, endpoint=endpoint,
        fragmentation=allocator_fragmentation, sample_seq=(lambda: recording.seq) if recording else None,
        tick_s=server.sample_interval_s, on_spec=on_spec,
    )
    if recording is not None:
        recording.on_sample = publisher.notify
    return publisher
