"""Which reading stands for memory pressure on this node: the pressure signal (docs/gpu.md).

``kvCache``: the engine's own KV-cache use (0..1). ``gpuMemory``: the fullest GPU's memory
used/total as the GPU source reads it (NVML; on a node without GPU the CPU source, whose
"memory" is the KV cache again). ``auto``: ``kvCache`` for an engine that pre-allocates its GPU
memory at start (vLLM takes ``gpu_memory_utilization`` of each GPU for weights, activations and
the whole KV cache, so NVML's used/total is nearly constant whatever the load, and its busy GPU
reads ~100 % utilisation), ``gpuMemory`` otherwise. The scheduler's gate and the GPU map's
admission both read the resolved signal, so they agree. Plain data, no imports above this layer.
"""

from __future__ import annotations

AUTO, KV_CACHE, GPU_MEMORY = "auto", "kvCache", "gpuMemory"
PRESSURE_SIGNALS = (AUTO, KV_CACHE, GPU_MEMORY)


def resolve_pressure_signal(setting: str, engine_preallocates: bool) -> str:
    """``KV_CACHE`` or ``GPU_MEMORY`` for ``setting`` (one of :data:`PRESSURE_SIGNALS`, else ValueError)."""
    if setting == AUTO:
        return KV_CACHE if engine_preallocates else GPU_MEMORY
    if setting not in (KV_CACHE, GPU_MEMORY):
        raise ValueError(f"pressure signal must be one of {', '.join(PRESSURE_SIGNALS)}, got {setting!r}")
    return setting
