"""What the pressure signal and the GPU map conclude on a real GPU held the way vLLM holds it.

    PYTHONPATH=.:operator:runtime:client:bpf python3 bench/gpu_pressure_check.py [--fraction 0.9] [--seconds 8]
    PYTHONPATH=.:operator:runtime:client:bpf python3 bench/gpu_pressure_check.py --cpu    # no GPU: the double

No vLLM is needed: torch pre-allocates ``--fraction`` of GPU 0's memory (as vLLM's
``gpu_memory_utilization`` does at start) and keeps the GPU busy with bf16 matmuls (as a serving
engine does), while the real NVML source (``zerolayer.runtime.gpu.nvml.NvmlSource``) reads it every
200 ms. It prints, per phase (idle / allocated / allocated and busy), the memory fraction,
utilisation and power NVML reports; then, for the busy readings and two KV-cache uses an engine
could report (``--kv``, default 0.30 and 0.95), what the micro-scheduler's gate and the GPU map
conclude under ``pressureSignal: kvCache`` (what ``auto`` means for vLLM) and under ``gpuMemory``
(the pre-issue-27 behaviour). Exit 0 when the kvCache conclusions follow the KV cache (admit at
0.30, shed and leave the map at 0.95) and NVML saw the allocation; 1 otherwise; 2 when there is no
GPU (then say ``--cpu``: the readings come from ``SimulatedGpuSource.under_vllm()``, named as a
simulation). ``--json FILE`` writes everything printed as one JSON document.

Imports only the standard library, PyYAML, nvidia-ml-py and torch besides zerolayer modules that
need nothing more (the GPU sources, ``gpu.signal``, the gossip status planner, the map reader): it
runs on a lent GPU machine with no install. The gate's marks are the scheduler's defaults
(``GossipSettings``: low sheds at 0.92, resumes below 0.88; the scheduler package itself needs
prometheus_client, so it is not imported here).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any, Sequence

from zerolayer.gpumap import node_from_object
from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load
from zerolayer.runtime.gpu.api import GpuReading, GpuSourceError
from zerolayer.runtime.gpu.signal import GPU_MEMORY, KV_CACHE

WALL = time.time()


class NoGpu(RuntimeError):
    """No CUDA GPU or no NVML here: the check cannot run for real."""


def summarize(name: str, readings: Sequence[Sequence[GpuReading]]) -> dict[str, Any]:
    rs = [r[0] for r in readings if r]
    if not rs:
        return {"phase": name, "samples": 0}
    power = [r.power_watts for r in rs if r.power_watts is not None]
    return {"phase": name, "samples": len(rs), "gpu": rs[0].name, "uuid": rs[0].uuid,
            "memory_fraction": round(sum(r.memory_fraction for r in rs) / len(rs), 4),
            "memory_used_gib": round(rs[-1].memory_used_bytes / 2**30, 2),
            "memory_total_gib": round(rs[-1].memory_total_bytes / 2**30, 2),
            "utilization_mean": round(sum(r.utilization for r in rs) / len(rs), 3),
            "utilization_max": round(max(r.utilization for r in rs), 3),
            "power_watts_mean": round(sum(power) / len(power), 1) if power else None}


def conclude(readings: Sequence[GpuReading], kv: float, signal: str) -> dict[str, Any]:
    """The gate's and the map's verdict for these NVML readings and an engine KV-cache use ``kv``."""
    settings = GossipSettings(pressure_signal=signal)
    fraction = kv if signal == KV_CACHE else max(r.memory_fraction for r in readings)
    # the micro-scheduler's low-priority gate from admitting (PressureGate: shed at >= shed_at)
    shedding_low = fraction >= settings.memory_threshold
    state = GossipState(settings, endpoint="https://check:8443", engine_preallocates=True)
    plan = state.plan(readings, Load(running=8, waiting=0, kv_cache_usage=kv), 0.0, WALL)
    assert plan is not None  # the first plan always goes out
    node = node_from_object({"metadata": {"name": "check"}, "spec": {"nodeName": "check"}, "status": plan.status},
                            now=WALL)
    return {"signal": signal, "kv_cache_usage": kv, "pressure_fraction": round(fraction, 4),
            "low_shed": shedding_low, "runtime_publishes_admitting": plan.status["admitting"],
            "map_admits": node.admitting, "map_reason": node.reason or "-", "gpus_admitting": node.gpus_admitting}


class Sampler(threading.Thread):
    def __init__(self, source: Any, interval_s: float = 0.2) -> None:
        super().__init__(name="nvml-sampler", daemon=True)
        self.source, self.interval_s = source, interval_s
        self.readings: list[Sequence[GpuReading]] = []
        self.stop = threading.Event()
        self.error: GpuSourceError | None = None

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.readings.append(self.source.sample())
            except GpuSourceError as exc:
                self.error = exc
                return

    def take(self) -> list[Sequence[GpuReading]]:
        out, self.readings = self.readings, []
        return out


def measure_gpu(fraction: float, seconds: float) -> list[dict[str, Any]]:
    """Phases on GPU 0 through the real NVML source; raises NoGpu where there is none."""
    try:
        import torch
    except ImportError as exc:
        raise NoGpu(f"torch is not installed ({exc})") from exc
    if not torch.cuda.is_available():
        raise NoGpu("torch.cuda.is_available() is False")
    from zerolayer.runtime.gpu.nvml import NvmlSource

    try:
        probe = NvmlSource()
    except GpuSourceError as exc:
        raise NoGpu(str(exc)) from exc
    # NVML and CUDA may number GPUs differently (CUDA_VISIBLE_DEVICES): match CUDA device 0 by UUID.
    cuda_uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")).lower()
    index = next((r.index for r in probe.sample() if cuda_uuid and cuda_uuid in r.uuid.lower()), 0)
    probe.close()
    source = NvmlSource([index])
    sampler = Sampler(source)
    sampler.start()
    phases = []
    try:
        time.sleep(min(2.0, seconds / 3))
        phases.append(summarize("idle", sampler.take()))
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        c = a @ b  # the workspace cuBLAS needs is allocated before the block below
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        block_bytes = max(0, int(fraction * total) - (total - free))
        block = torch.empty(block_bytes, dtype=torch.uint8, device="cuda")  # noqa: F841 (held: that is the point)
        torch.cuda.synchronize()
        time.sleep(0.3)
        sampler.take()  # samples taken while allocating
        time.sleep(min(2.0, seconds / 3))
        phases.append(summarize("allocated", sampler.take()))
        phases[-1]["target_fraction"] = fraction
        ends = time.monotonic() + seconds
        warm = time.monotonic() + 1.0  # NVML utilisation is averaged over its own window
        while time.monotonic() < ends:
            for _ in range(20):
                c = a @ b
            torch.cuda.synchronize()
            if warm and time.monotonic() >= warm:
                sampler.take()
                warm = 0.0
        phases.append(summarize("allocated+busy", sampler.take()))
        phases[-1]["target_fraction"] = fraction
        phases[-1]["last_readings"] = sampler_last(source)
        del c
    finally:
        sampler.stop.set()
        sampler.join(2)
        source.close()
    if sampler.error is not None:
        raise sampler.error
    return phases


def sampler_last(source: Any) -> list[dict[str, Any]]:
    return [{"uuid": r.uuid, "memory_used_bytes": r.memory_used_bytes, "memory_total_bytes": r.memory_total_bytes,
             "utilization": r.utilization, "power_watts": r.power_watts} for r in source.sample()]


def as_readings(phase: dict[str, Any]) -> list[GpuReading]:
    return [GpuReading(uuid=r["uuid"], index=0, name=phase.get("gpu", ""), memory_used_bytes=r["memory_used_bytes"],
                       memory_total_bytes=r["memory_total_bytes"], utilization=r["utilization"],
                       power_watts=r["power_watts"]) for r in phase["last_readings"]]


def simulated_phases(fraction: float) -> list[dict[str, Any]]:
    from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

    source = SimulatedGpuSource.under_vllm(gpu_memory_utilization=fraction)
    busy = summarize("allocated+busy (SIMULATED: SimulatedGpuSource.under_vllm, not a GPU)", [source.sample()])
    busy["target_fraction"] = fraction
    busy["last_readings"] = sampler_last(source)
    return [busy]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: read the simulated double instead of NVML")
    parser.add_argument("--fraction", type=float, default=0.9, help="GPU memory to pre-allocate (vLLM's default 0.9)")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long to keep the GPU busy")
    parser.add_argument("--kv", default="0.30,0.95", help="engine KV-cache uses to conclude for")
    parser.add_argument("--json", help="write the whole result here")
    args = parser.parse_args()
    kvs = [float(k) for k in args.kv.split(",")]

    try:
        phases = simulated_phases(args.fraction) if args.cpu else measure_gpu(args.fraction, args.seconds)
    except NoGpu as exc:
        print(f"gpu_pressure_check: no GPU here ({exc}); run with --cpu to check the script against the "
              "simulated double", file=sys.stderr)
        return 2
    print(f"{'phase':<16} {'samples':>7} {'memory':>7} {'used GiB':>9} {'util mean':>9} {'util max':>8} {'power W':>8}")
    for p in phases:
        print(f"{p['phase'][:16]:<16} {p['samples']:>7} {p.get('memory_fraction', 0):>7.3f} "
              f"{p.get('memory_used_gib', 0):>9.2f} {p.get('utilization_mean', 0):>9.3f} "
              f"{p.get('utilization_max', 0):>8.3f} {str(p.get('power_watts_mean')):>8}")
    busy = phases[-1]
    readings = as_readings(busy)
    verdicts = [conclude(readings, kv, signal) for signal in (KV_CACHE, GPU_MEMORY) for kv in kvs]
    print(f"\n{'signal':<10} {'kv':>5} {'pressure':>8} {'low shed':>8} {'runtime admits':>14} {'map admits':>10}  reason")
    for v in verdicts:
        print(f"{v['signal']:<10} {v['kv_cache_usage']:>5.2f} {v['pressure_fraction']:>8.3f} {str(v['low_shed']):>8} "
              f"{str(v['runtime_publishes_admitting']):>14} {str(v['map_admits']):>10}  {v['map_reason']}")

    problems = []
    for v in verdicts:
        if v["signal"] != KV_CACHE:
            continue
        full = v["kv_cache_usage"] >= 0.92
        if v["low_shed"] != full or v["map_admits"] == full:
            problems.append(f"kvCache at {v['kv_cache_usage']}: shed={v['low_shed']} map_admits={v['map_admits']}")
    if abs(busy.get("memory_fraction", 0) - args.fraction) > 0.05:
        problems.append(f"NVML memory fraction {busy.get('memory_fraction')} is not near the allocated {args.fraction}")
    if busy.get("utilization_mean", 0) < 0.5:
        problems.append(f"NVML utilisation {busy.get('utilization_mean')} while busy: the matmuls did not show")
    print("\nbefore issue 27 (gpuMemory + utilisation threshold) a busy vLLM GPU reads "
          f"{busy.get('memory_fraction')} memory and {busy.get('utilization_mean')} utilisation: "
          "the rows above say what that concluded.")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"simulated": args.cpu, "phases": phases, "verdicts": verdicts, "problems": problems}, out,
                      indent=2)
    for p in problems:
        print(f"PROBLEM: {p}")
    print("gpu_pressure_check:", "FAILED" if problems else "ok", "(SIMULATED)" if args.cpu else "")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
