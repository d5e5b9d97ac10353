"""The simulated and CPU sources, and the sampler."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from zerolayer.runtime.gpu import CpuSource, GpuSample, GpuSampler, GpuSourceError, SimulatedGpuSource

pytestmark = pytest.mark.timeout(30)

CLIMB = {
    "name": "climb-and-fall",
    "gpus": [{"name": "Simulated H100", "memory_total_bytes": 10**6, "steps": [
        {"memory": [0.5, 0.97], "samples": 5, "utilization": [0.2, 0.9]},
        {"memory": 0.97, "samples": 2, "power_watts": 700, "temperature_c": 80},
        {"memory": [0.97, 0.6], "samples": 3},
    ]}],
}


def fractions(source, n):
    return [round(source.sample()[0].memory_fraction, 4) for _ in range(n)]


def test_simulated_scenario_ramps_holds_and_falls():
    source = SimulatedGpuSource(CLIMB)
    assert source.kind == "simulated" and source.length == 10
    assert fractions(source, 10) == [0.5, 0.6175, 0.735, 0.8525, 0.97, 0.97, 0.97, 0.97, 0.785, 0.6]
    assert fractions(source, 2) == [0.6, 0.6]  # at_end: hold


def test_simulated_reading_fields():
    source = SimulatedGpuSource(CLIMB)
    first = source.sample()[0]
    assert (first.uuid, first.index, first.name, first.memory_total_bytes) == ("SIM-GPU-0000", 0, "Simulated H100", 10**6)
    assert first.utilization == pytest.approx(0.2) and first.power_watts is None and first.nvlink_errors is None
    for _ in range(5):
        held = source.sample()[0]
    assert held.power_watts == 700 and held.temperature_c == 80 and held.memory_used_bytes == 970_000


@pytest.mark.parametrize("at_end, expected", [("repeat", [0.1, 0.2, 0.1, 0.2]), ("hold", [0.1, 0.2, 0.2, 0.2])])
def test_simulated_at_end(at_end, expected):
    source = SimulatedGpuSource({"at_end": at_end, "gpus": [{"steps": [{"memory": [0.1, 0.2], "samples": 2}]}]})
    assert fractions(source, 4) == expected


def test_simulated_at_end_error_and_close():
    source = SimulatedGpuSource({"at_end": "error", "gpus": [{"steps": [{"memory": 0.1, "samples": 1}]}]})
    source.sample()
    with pytest.raises(GpuSourceError, match="ended after 1 samples"):
        source.sample()
    source.close()
    with pytest.raises(GpuSourceError, match="closed"):
        source.sample()


def test_simulated_several_gpus_and_manual_override():
    source = SimulatedGpuSource({"gpus": [{"steps": [{"memory": 0.3, "samples": 1}]},
                                          {"steps": [{"memory": [0.4, 0.6], "samples": 3}]}]})
    assert [r.index for r in source.sample()] == [0, 1]
    source.set_memory(0.95, gpu=0)
    readings = source.sample()
    assert readings[0].memory_fraction == pytest.approx(0.95) and readings[1].memory_fraction == pytest.approx(0.5)
    assert SimulatedGpuSource.constant(0.42).sample()[0].memory_fraction == pytest.approx(0.42)


def test_simulated_from_yaml(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: y\ngpus:\n  - steps:\n      - {memory: [0.5, 0.9], samples: 2}\n")
    assert fractions(SimulatedGpuSource.from_yaml(path), 2) == [0.5, 0.9]
    with pytest.raises(GpuSourceError, match="cannot read scenario"):
        SimulatedGpuSource.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("scenario, message", [
    ({}, "at least one entry under gpus"),
    ({"gpus": [{"steps": []}]}, "no steps"),
    ({"gpus": [{"steps": [{"memory": 0.5}]}]}, "samples >= 1"),
    ({"gpus": [{"steps": [{"memory": 1.5, "samples": 1}]}]}, "outside 0..1"),
    ({"gpus": [{"steps": [{"memory": [0.1, 0.2, 0.3], "samples": 2}]}]}, r"\[from, to\]"),
    ({"at_end": "loop", "gpus": [{"steps": [{"memory": 0.1, "samples": 1}]}]}, "at_end"),
    ([1, 2], "mapping"),
])
def test_simulated_scenario_errors(scenario, message):
    with pytest.raises(GpuSourceError, match=message):
        SimulatedGpuSource(scenario)


# ------------------------------------------------------------------ CPU source
def test_cpu_source_reports_kv_cache_use_and_process_memory():
    usage = [0.25]
    source = CpuSource(lambda: usage[0], kv_cache_bytes=4096)
    (reading,) = source.sample()
    assert source.kind == "cpu" and reading.memory_fraction == pytest.approx(0.25)
    assert reading.memory_total_bytes == 4096 and reading.index == 0 and reading.uuid.startswith("CPU-")
    me = [p for p in reading.processes if p.pid == os.getpid()]
    assert me and me[0].used_memory_bytes > 10 * 1024**2  # a Python process has > 10 MiB resident
    sum(i * i for i in range(300_000))  # burn some CPU so the next utilisation is measured over real work
    usage[0] = 1.7  # out of range: clamped
    (second,) = source.sample()
    assert second.memory_fraction == 1.0
    assert 0.0 <= second.utilization <= 1.0


def test_cpu_source_lists_child_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        source = CpuSource(lambda: 0.1)
        assert child.pid in source.processes()
        assert child.pid not in CpuSource(lambda: 0.1, include_children=False).processes()
    finally:
        child.kill()
        child.wait()


def test_cpu_source_converts_engine_errors():
    def broken() -> float:
        raise KeyError("kv_cache_usage")

    with pytest.raises(GpuSourceError, match="KV-cache use") as info:
        CpuSource(broken).sample()
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(GpuSourceError, match="NaN"):
        CpuSource(lambda: float("nan")).sample()


def test_cpu_source_fails_when_the_engine_process_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(GpuSourceError, match="exists any more"):
        CpuSource(lambda: 0.1, pids=[child.pid], include_children=False).sample()


# ------------------------------------------------------------------ sampler
def test_sampler_delivers_samples_in_its_thread_and_reports_errors():
    source = SimulatedGpuSource({"at_end": "error", "gpus": [{"steps": [{"memory": [0.1, 0.3], "samples": 3}]}]})
    got: list[GpuSample] = []
    done = threading.Event()
    threads = set()

    def on_sample(sample: GpuSample) -> None:
        threads.add(threading.current_thread().name)
        got.append(sample)
        if len(got) == 5:
            done.set()

    with GpuSampler(source, on_sample, interval_s=0.01):
        assert done.wait(10)
    assert [round(s.memory_fraction, 2) for s in got[:3]] == [0.1, 0.2, 0.3]
    assert got[3].error is not None and got[3].memory_fraction is None
    assert threads == {"gpu-sampler"}
    assert all(a.sampled_at <= b.sampled_at for a, b in zip(got, got[1:]))


def test_sampler_keeps_going_when_the_consumer_fails(caplog):
    calls = []
    done = threading.Event()

    def flaky(sample):
        calls.append(sample)
        if len(calls) == 3:
            done.set()
        if len(calls) == 1:
            raise RuntimeError("consumer bug")

    with GpuSampler(SimulatedGpuSource.constant(0.5), flaky, interval_s=0.01):
        assert done.wait(10)
    assert "GPU sample consumer failed" in caplog.text


async def test_sampler_hands_samples_to_the_event_loop():
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[GpuSample, int]] = asyncio.Queue()
    sampler = GpuSampler(SimulatedGpuSource.constant(0.5), lambda s: queue.put_nowait((s, threading.get_ident())),
                         interval_s=0.01, loop=loop).start()
    try:
        sample, ident = await asyncio.wait_for(queue.get(), 10)
    finally:
        await asyncio.to_thread(sampler.stop)
    assert ident == threading.get_ident()  # ran on the loop's thread
    assert sample.memory_fraction == pytest.approx(0.5)
    assert not sampler.running


def test_sampler_rejects_a_bad_interval():
    with pytest.raises(ValueError):
        GpuSampler(SimulatedGpuSource.constant(0.5), print, interval_s=0)


def test_readings_cli_prints_a_simulated_table(capsys, tmp_path):
    from zerolayer.runtime.gpu.__main__ import main

    path = tmp_path / "s.yaml"
    path.write_text("gpus:\n  - {name: Sim, steps: [{memory: [0.5, 0.9], samples: 2}]}\n")
    assert main(["--source", "simulated", "--scenario", str(path), "--samples", "2", "--interval", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "50.0%" in out[1] and "90.0%" in out[2]
