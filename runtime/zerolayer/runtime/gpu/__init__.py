"""GPU readings for the runtime: one interface (:mod:`.api`), three sources, a sampler.

``NvmlSource`` (real GPUs, nvidia-ml-py), ``CpuSource`` (no GPU: engine KV cache + /proc),
``SimulatedGpuSource`` (scripted scenarios for tests and demos). Importing this package does
not import NVML; ``NvmlSource`` loads it when constructed. See docs/gpu.md.
"""

from .api import GpuProcess, GpuReading, GpuSource, GpuSourceError
from .cpu import CpuSource
from .nvml import NvmlSource
from .sampler import DEFAULT_INTERVAL_S, GpuSample, GpuSampler
from .simulated import SimulatedGpuSource

__all__ = [
    "CpuSource", "DEFAULT_INTERVAL_S", "GpuProcess", "GpuReading", "GpuSample", "GpuSampler", "GpuSource",
    "GpuSourceError", "NvmlSource", "SimulatedGpuSource",
]
