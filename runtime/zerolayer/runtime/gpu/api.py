"""GPU readings: one interface, several sources.

Sources (implementations live beside this file): ``nvml`` (real NVIDIA GPUs through
nvidia-ml-py), ``cpu`` (no GPU: the engine's KV-cache use and process memory stand in
for GPU memory), ``simulated`` (a scripted scenario for tests and demos, named as a
simulation). ``sample()`` may block (NVML calls do): callers run it in a thread,
never on the event loop.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int


@dataclasses.dataclass(frozen=True)
class GpuReading:
    uuid: str
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1, compute utilisation over the last sample period
    power_watts: float | None = None
    temperature_c: float | None = None
    processes: Sequence[GpuProcess] = ()
    nvlink_errors: int | None = None  # None when the device has no NVLink
    fragmentation: float | None = None  # 0..1, see docs/gpu.md for the definition

    @property
    def memory_fraction(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0


class GpuSourceError(RuntimeError):
    """A GPU source could not produce a reading (driver gone, scenario exhausted...)."""


class GpuSource(Protocol):
    kind: str  # "nvml" | "cpu" | "simulated"

    def sample(self) -> Sequence[GpuReading]: ...
    def close(self) -> None: ...
