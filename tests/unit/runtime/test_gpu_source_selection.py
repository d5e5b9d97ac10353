"""Which GPU source a runtime reads: ``auto`` is NVML where the process has NVIDIA GPUs, else the
CPU source; operator-deployed runtimes get ``auto`` (or ``cpu`` with no GPUs); the simulated
source only when a config names it. NVML itself cannot run here (no GPU): the choice is tested
over environments and loaders, and the NVML source is replaced where it would start."""

from __future__ import annotations

import pathlib

import pytest

from zerolayer.runtime import config as runtime_config
from zerolayer.runtime.config import build_gpu_source, parse_config
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.gpu.api import GpuSourceError
from zerolayer.runtime.gpu.cpu import CpuSource
from zerolayer.runtime.gpu.select import NVML_LIBRARY, choose_source, devices_hidden, nvml_loadable
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource
from zerolayer.runtime.node.incluster import config_from_inferencenode

REPO = pathlib.Path(__file__).resolve().parents[3]


def never() -> bool:
    raise AssertionError("the NVML library must not be loaded when the devices are hidden")


@pytest.mark.parametrize("environ, loads, source", [
    ({}, True, "nvml"),                                          # bare metal with a driver
    ({}, False, "cpu"),                                          # no driver
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, False, "cpu"),           # CUDA image on a machine without GPUs
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-1f2e,GPU-9a"}, True, "nvml"),  # the device plugin's allocation
    ({"NVIDIA_VISIBLE_DEVICES": "0"}, True, "nvml"),
])
def test_auto_reads_nvml_only_where_gpus_are_visible_and_nvml_loads(environ, loads, source):
    chosen, why = choose_source(environ, lambda: loads)
    assert chosen == source and why


@pytest.mark.parametrize("value", ["void", "none", "", " NONE "])
def test_hidden_devices_mean_cpu_without_touching_the_driver(value):
    assert devices_hidden({"NVIDIA_VISIBLE_DEVICES": value})
    chosen, why = choose_source({"NVIDIA_VISIBLE_DEVICES": value}, never)
    assert chosen == "cpu" and "NVIDIA_VISIBLE_DEVICES" in why


def test_nvml_loadable_asks_for_the_driver_library():
    asked = []

    def missing(name):  # type: ignore[no-untyped-def]
        asked.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    assert nvml_loadable(missing) is False and asked == [NVML_LIBRARY]
    assert nvml_loadable(lambda name: object()) is True


def gpu_config(**gpu):  # type: ignore[no-untyped-def]
    return parse_config({"engine": {"kind": "synthetic"}, "gpu": gpu}, REPO, environ={})


def test_auto_without_gpus_builds_the_cpu_source():
    source = build_gpu_source(gpu_config(source="auto", kv_cache_bytes=1 << 26), SyntheticEngine(),
                              environ={}, loadable=lambda: False)
    assert isinstance(source, CpuSource)
    [reading] = source.sample()
    assert reading.memory_total_bytes == 1 << 26


def test_auto_with_gpus_builds_the_nvml_source(monkeypatch):
    started = []
    monkeypatch.setattr(runtime_config, "_nvml_source", lambda spec: started.append(spec) or "nvml-source")
    source = build_gpu_source(gpu_config(source="auto"), SyntheticEngine(),
                              environ={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, loadable=lambda: True)
    assert source == "nvml-source" and len(started) == 1


def test_auto_falls_back_to_cpu_when_nvml_will_not_start(monkeypatch, caplog):
    def fails(spec):  # type: ignore[no-untyped-def]
        raise GpuSourceError("NVML could not start (no NVIDIA driver or GPU?)")

    monkeypatch.setattr(runtime_config, "_nvml_source", fails)
    source = build_gpu_source(gpu_config(source="auto"), SyntheticEngine(), environ={}, loadable=lambda: True)
    assert isinstance(source, CpuSource)
    assert "NVML did not start" in caplog.text


def test_a_configured_nvml_source_still_fails_loudly(monkeypatch):
    def fails(spec):  # type: ignore[no-untyped-def]
        raise GpuSourceError("no GPU")

    monkeypatch.setattr(runtime_config, "_nvml_source", fails)
    with pytest.raises(GpuSourceError):
        build_gpu_source(gpu_config(source="nvml"), SyntheticEngine(), environ={}, loadable=lambda: True)


def test_simulated_only_when_asked():
    assert isinstance(build_gpu_source(gpu_config(source="simulated", memory=0.3), SyntheticEngine()),
                      SimulatedGpuSource)
    with pytest.raises(ConfigError, match="gpu.source"):
        gpu_config(source="fake")


def inode(**runtime):  # type: ignore[no-untyped-def]
    return {"metadata": {"name": "n"}, "spec": {"nodeName": "n", "models": [{"name": "m", "source": {"path": "/m"}}],
                                                "runtime": {"engine": "synthetic", **runtime}}}


def test_operator_deployed_runtimes_publish_real_readings():
    assert config_from_inferencenode(inode(gpus=2))["gpu"] == {"source": "auto"}
    assert config_from_inferencenode(inode())["gpu"] == {"source": "auto"}  # gpus defaults to 1
    # no GPUs requested: CPU readings even where a CUDA image says NVIDIA_VISIBLE_DEVICES=all
    assert config_from_inferencenode(inode(gpus=0, kvCacheBytes=1 << 26))["gpu"] == {
        "source": "cpu", "kv_cache_bytes": 1 << 26}
    # a base config (tests, demos) keeps its own source, the simulated one included
    base = {"gpu": {"source": "simulated", "memory": 0.5}}
    assert config_from_inferencenode(inode(gpus=2), base)["gpu"] == base["gpu"]
