"""The NVML source.

``FakeNvmlLibrary`` below is a **test double for absent hardware**: this machine has no
NVIDIA GPU, so the source's conversion logic (units, unsupported fields, NVLink sums, error
conversion) is exercised against a stand-in with pynvml's function names and exception
classes. ``test_real_nvml`` talks to the real driver and skips, saying why, without a GPU.
"""

from __future__ import annotations

import types

import pytest

from zerolayer.runtime.gpu import GpuSourceError, NvmlSource

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")


class FakeNvmlLibrary:
    """Test double standing in for the NVML driver library (no GPU here). Real pynvml exceptions."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_NVLINK_ERROR_DL_REPLAY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
    NVML_NVLINK_ERROR_DL_CRC_FLIT = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_ERROR_DL_CRC_DATA = pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA

    def __init__(self, gpus, *, init_error=None):
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = 0
        self.fail_memory = None

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"].encode()  # old bindings return bytes

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        if self.fail_memory is not None:
            raise self.fail_memory
        return types.SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=h["util"], memory=10)

    def nvmlDeviceGetPowerUsage(self, h):
        if h.get("power_mw") is None:
            raise pynvml.NVMLError_NotSupported()
        return h["power_mw"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return h["temp"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in h["procs"]]

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = h.get("links")
        if links is None:
            raise pynvml.NVMLError_NotSupported()
        if link >= len(links):
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_FEATURE_ENABLED if links[link] is not None else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return h["links"][link][counter]


def gpu(i, **extra):
    base = {"uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "total": 80 * 2**30, "used": 40 * 2**30,
            "util": 73, "power_mw": 350_000, "temp": 61, "procs": [(1234, 2**30), (99, None)], "links": None}
    base.update(extra)
    return base


def test_readings_are_converted_to_our_units():
    lib = FakeNvmlLibrary([gpu(0), gpu(1, used=60 * 2**30, power_mw=None)])
    source = NvmlSource(library=lib)
    r0, r1 = source.sample()
    assert source.kind == "nvml"
    assert (r0.uuid, r0.index, r0.name) == ("GPU-0", 0, "NVIDIA H100 80GB HBM3")
    assert r0.memory_fraction == pytest.approx(0.5) and r1.memory_fraction == pytest.approx(0.75)
    assert r0.utilization == pytest.approx(0.73) and r0.power_watts == 350.0 and r0.temperature_c == 61.0
    assert r1.power_watts is None  # not supported on that board
    assert [(p.pid, p.used_memory_bytes) for p in r0.processes] == [(1234, 2**30), (99, 0)]
    assert r0.nvlink_errors is None  # no NVLink
    source.close()
    source.close()
    assert lib.initialised == 0


def test_nvlink_errors_are_summed_over_active_links():
    counters = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 1, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 0,
                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 2, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 3}
    lib = FakeNvmlLibrary([gpu(0, links=[counters, None, counters])])
    (reading,) = NvmlSource(library=lib).sample()
    assert reading.nvlink_errors == 12
    lib = FakeNvmlLibrary([gpu(0, links=[None, None])])
    (reading,) = NvmlSource(library=lib).sample()
    assert reading.nvlink_errors is None  # links exist but none active


def test_a_subset_of_gpus():
    source = NvmlSource([1], library=FakeNvmlLibrary([gpu(0), gpu(1)]))
    assert [r.uuid for r in source.sample()] == ["GPU-1"]
    with pytest.raises(GpuSourceError, match=r"indices \[5\] do not exist"):
        NvmlSource([5], library=FakeNvmlLibrary([gpu(0)]))


def test_nvml_errors_become_gpu_source_errors():
    with pytest.raises(GpuSourceError, match="NVML could not start") as info:
        NvmlSource(library=FakeNvmlLibrary([], init_error=pynvml.NVMLError_DriverNotLoaded()))
    assert isinstance(info.value.__cause__, pynvml.NVMLError)
    lib = FakeNvmlLibrary([gpu(0)])
    source = NvmlSource(library=lib)
    lib.fail_memory = pynvml.NVMLError_GpuIsLost()
    with pytest.raises(GpuSourceError, match="reading GPU 0 \\(GPU-0\\)"):
        source.sample()
    source.close()
    with pytest.raises(GpuSourceError, match="closed"):
        source.sample()


def _nvml_available() -> str | None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA GPU/driver on this machine: {exc}"
    try:
        return None if pynvml.nvmlDeviceGetCount() > 0 else "NVML sees no GPU"
    finally:
        pynvml.nvmlShutdown()


def test_real_nvml():
    reason = _nvml_available()
    if reason:
        pytest.skip(reason)
    source = NvmlSource()
    try:
        readings = source.sample()
    finally:
        source.close()
    assert readings
    for r in readings:
        assert r.uuid.startswith(("GPU-", "MIG-")) and r.memory_total_bytes > 0
        assert 0.0 <= r.memory_fraction <= 1.0 and 0.0 <= r.utilization <= 1.0
