"""A *simulated* GPU source: plays a scripted scenario, for tests and demos. Not a GPU.

A scenario is a mapping (or a YAML file with the same shape)::

    name: climb-and-fall
    at_end: hold            # hold (repeat the last reading) | repeat (start over) | error
    gpus:
      - name: Simulated H100
        memory_total_bytes: 85899345920
        steps:
          - {memory: [0.5, 0.97], samples: 10}     # linear ramp, both ends included
          - {memory: 0.97, samples: 5, utilization: 0.99}
          - {memory: [0.97, 0.6], samples: 8}

Each step lasts ``samples`` samples; ``memory`` and ``utilization`` (default 0.5) are a
constant or a ``[from, to]`` ramp; ``power_watts`` and ``temperature_c`` likewise (optional).
Every GPU of a scenario advances one step-sample per ``sample()`` call; a GPU whose steps
run out before the others keeps its last reading. ``set_memory`` overrides the script for
tests that drive the source by hand.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any, Mapping, Sequence

import yaml

from .api import GpuProcess, GpuReading, GpuSourceError

DEFAULT_TOTAL = 80 * 1024**3
AT_END = ("hold", "repeat", "error")


def _ramp(value: Any, i: int, n: int, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise GpuSourceError(f"scenario: {field} ramp must be [from, to], got {value!r}")
        start, end = float(value[0]), float(value[1])
        return start if n <= 1 else start + (end - start) * i / (n - 1)
    return float(value)


class _ScriptedGpu:
    def __init__(self, index: int, spec: Mapping[str, Any]) -> None:
        self.index = index
        self.name = str(spec.get("name", "Simulated GPU"))
        self.uuid = str(spec.get("uuid", f"SIM-GPU-{index:04d}"))
        self.total = int(spec.get("memory_total_bytes", DEFAULT_TOTAL))
        self.nvlink_errors = spec.get("nvlink_errors")
        self.processes = tuple(GpuProcess(int(p["pid"]), int(p["used_memory_bytes"]))
                               for p in spec.get("processes", ()))
        self.readings: list[dict[str, float | None]] = []
        for n_step, step in enumerate(spec.get("steps", ())):
            try:
                n = int(step["samples"])
                if n < 1 or "memory" not in step:
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise GpuSourceError(f"scenario gpu {index} step {n_step}: need memory and samples >= 1, "
                                     f"got {step!r}") from None
            for i in range(n):
                memory = _ramp(step["memory"], i, n, "memory")
                if memory is None or not 0.0 <= memory <= 1.0:
                    raise GpuSourceError(f"scenario gpu {index} step {n_step}: memory {memory} outside 0..1")
                self.readings.append({
                    "memory": memory,
                    "utilization": _ramp(step.get("utilization", 0.5), i, n, "utilization"),
                    "power_watts": _ramp(step.get("power_watts"), i, n, "power_watts"),
                    "temperature_c": _ramp(step.get("temperature_c"), i, n, "temperature_c"),
                })
        if not self.readings:
            raise GpuSourceError(f"scenario gpu {index}: no steps")

    def reading(self, position: int, memory_override: float | None) -> GpuReading:
        values = self.readings[min(position, len(self.readings) - 1)]
        memory = values["memory"] if memory_override is None else memory_override
        utilization = values["utilization"]
        assert memory is not None and utilization is not None  # checked when the scenario was read
        return GpuReading(
            uuid=self.uuid, index=self.index, name=self.name,
            memory_used_bytes=round(memory * self.total), memory_total_bytes=self.total,
            utilization=float(utilization), power_watts=values["power_watts"],
            temperature_c=values["temperature_c"], processes=self.processes, nvlink_errors=self.nvlink_errors,
        )


class SimulatedGpuSource:
    """Plays a scripted scenario (see module docstring). Thread-safe; ``sample()`` never blocks."""

    kind = "simulated"

    def __init__(self, scenario: Mapping[str, Any]) -> None:
        if not isinstance(scenario, Mapping):
            raise GpuSourceError(f"scenario must be a mapping, got {type(scenario).__name__}")
        self.name = str(scenario.get("name", "scenario"))
        self.at_end = str(scenario.get("at_end", "hold"))
        if self.at_end not in AT_END:
            raise GpuSourceError(f"scenario at_end must be one of {AT_END}, got {self.at_end!r}")
        gpus = scenario.get("gpus")
        if not gpus:
            raise GpuSourceError("scenario needs at least one entry under gpus")
        self._gpus = [_ScriptedGpu(i, spec) for i, spec in enumerate(gpus)]
        self._length = max(len(g.readings) for g in self._gpus)
        self._position = 0
        self._override: dict[int, float] = {}
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def from_yaml(cls, path: str | pathlib.Path) -> "SimulatedGpuSource":
        try:
            data = yaml.safe_load(pathlib.Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise GpuSourceError(f"cannot read scenario {path}: {exc}") from exc
        return cls(data)

    @classmethod
    def constant(cls, memory: float, *, gpus: int = 1, utilization: float = 0.5) -> "SimulatedGpuSource":
        """A scenario that reads ``memory`` forever (drive it further with ``set_memory``)."""
        return cls({"name": "constant", "gpus": [{"steps": [{"memory": memory, "samples": 1,
                                                             "utilization": utilization}]}] * gpus})

    @classmethod
    def under_vllm(cls, *, gpus: int = 1, gpu_memory_utilization: float = 0.9, outside_vllm: float = 0.012,
                   utilization: float = 0.99, power_watts: float = 690.0) -> "SimulatedGpuSource":
        """What NVML reads on a GPU that vLLM serves from, busy: vLLM took ``gpu_memory_utilization``
        of the memory at start (weights, activations, its whole KV cache), the CUDA context and
        driver hold ``outside_vllm`` more, and the engine's steps keep the GPU near ``utilization``.
        Both stay there whatever the KV cache holds: the double for "GPU memory is no load signal
        under vLLM" (docs/gpu.md). A simulation, named as one; ``set_memory`` still overrides."""
        memory = min(1.0, gpu_memory_utilization + outside_vllm)
        spec = {"name": "Simulated H100 under vLLM", "memory_total_bytes": DEFAULT_TOTAL,
                "steps": [{"memory": memory, "samples": 1, "utilization": utilization, "power_watts": power_watts}]}
        return cls({"name": "vllm-preallocated", "gpus": [dict(spec, uuid=f"SIM-GPU-{i:04d}") for i in range(gpus)]})

    @property
    def length(self) -> int:
        """Samples in one pass of the scenario."""
        return self._length

    def set_memory(self, fraction: float, gpu: int | None = None) -> None:
        """Override the scripted memory fraction (of one GPU, or all) from now on."""
        with self._lock:
            for g in self._gpus if gpu is None else [self._gpus[gpu]]:
                self._override[g.index] = float(fraction)

    def sample(self) -> Sequence[GpuReading]:
        with self._lock:
            if self._closed:
                raise GpuSourceError(f"simulated source {self.name!r} is closed")
            position = self._position
            if position >= self._length:
                if self.at_end == "error":
                    raise GpuSourceError(f"simulated scenario {self.name!r} ended after {self._length} samples")
                if self.at_end == "repeat":
                    position = self._position = 0
            self._position = position + 1
            return [g.reading(position, self._override.get(g.index)) for g in self._gpus]

    def close(self) -> None:
        with self._lock:
            self._closed = True
