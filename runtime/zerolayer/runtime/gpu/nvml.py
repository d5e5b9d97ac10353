"""The NVML source: real NVIDIA GPUs through NVIDIA's own binding, ``nvidia-ml-py``.

Why ``nvidia-ml-py`` (import name ``pynvml``): it is the binding NVIDIA publishes and keeps
in step with the driver's NVML; the separate ``pynvml`` distribution on PyPI is now a thin
wrapper that depends on it, so we depend on the maintained one directly.

Every NVML call may block (the driver can take milliseconds): ``sample()`` runs in the
sampler's thread, never on the event loop. NVML errors are converted to
:class:`~zerolayer.runtime.gpu.api.GpuSourceError` where they enter our code; a field a
device does not support (power on some boards, NVLink on PCIe cards) is ``None`` instead.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, Sequence

from .api import GpuProcess, GpuReading, GpuSourceError


def _load_nvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise GpuSourceError("the NVML source needs nvidia-ml-py (pip install nvidia-ml-py)") from exc
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Readings of every GPU NVML sees (or of ``indices``).

    ``library`` is the ``pynvml`` module; tests without a GPU pass a test double with the
    same functions (named as one). Initialising NVML happens here, so a node without a
    driver fails at start-up with a clear message rather than at the first sample.
    """

    kind = "nvml"

    def __init__(self, indices: Sequence[int] | None = None, *, library: ModuleType | Any | None = None) -> None:
        self._nvml = library if library is not None else _load_nvml()
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise GpuSourceError(f"NVML could not start (no NVIDIA driver or GPU?): {exc}") from exc
        try:
            count = self._nvml.nvmlDeviceGetCount()
            wanted = list(range(count)) if indices is None else list(indices)
            bad = [i for i in wanted if not 0 <= i < count]
            if bad:
                raise GpuSourceError(f"GPU indices {bad} do not exist; NVML sees {count} GPU(s)")
            self._handles = [(i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in wanted]
            self._static = {i: (_text(self._nvml.nvmlDeviceGetUUID(h)), _text(self._nvml.nvmlDeviceGetName(h)))
                            for i, h in self._handles}
        except self._nvml.NVMLError as exc:
            self._shutdown()
            raise GpuSourceError(f"NVML could not list the GPUs: {exc}") from exc
        except GpuSourceError:
            self._shutdown()
            raise

    def sample(self) -> Sequence[GpuReading]:
        with self._lock:
            if self._closed:
                raise GpuSourceError("NVML source is closed")
            return [self._read(index, handle) for index, handle in self._handles]

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._shutdown()

    # ------------------------------------------------------------------ internals
    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass  # closing: nothing left to release if the driver is already gone

    def _optional(self, fn, *args):
        """Call NVML; ``None`` when the device does not support the query."""
        try:
            return fn(*args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def _read(self, index: int, handle: Any) -> GpuReading:
        nvml = self._nvml
        uuid, name = self._static[index]
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
            temperature = self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            procs = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
            nvlink = self._nvlink_errors(handle)
        except nvml.NVMLError as exc:
            raise GpuSourceError(f"NVML failed reading GPU {index} ({uuid}): {exc}") from exc
        return GpuReading(
            uuid=uuid, index=index, name=name,
            memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
            utilization=(util.gpu / 100.0) if util is not None else 0.0,
            power_watts=(power_mw / 1000.0) if power_mw is not None else None,
            temperature_c=float(temperature) if temperature is not None else None,
            # usedGpuMemory is None where the driver cannot attribute memory (MIG, some containers)
            processes=tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs),
            nvlink_errors=nvlink,
        )

    def _nvlink_errors(self, handle: Any) -> int | None:
        """Sum of the data-link error counters over active links; None without NVLink."""
        nvml = self._nvml
        counters = (nvml.NVML_NVLINK_ERROR_DL_REPLAY, nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                    nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, nvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
        total, active = 0, 0
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                break  # no NVLink, or past the device's last link
            if state != nvml.NVML_FEATURE_ENABLED:
                continue
            active += 1
            for counter in counters:
                value = self._optional(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
                total += int(value or 0)
        return total if active else None
