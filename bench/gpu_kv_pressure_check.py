"""On a real GPU, through the real runtime: pressure follows the KV cache, low-priority shedding fires at
its threshold, and the GPU map published from NVML is sane while the GPU reads ~100 % busy.

    PYTHONPATH=.:operator:runtime:client:bpf python3 bench/gpu_kv_pressure_check.py [--fraction 0.9] [--json OUT]
    PYTHONPATH=.:operator:runtime:client:bpf python3 bench/gpu_kv_pressure_check.py --cpu   # no GPU: a simulation

No vLLM (the lent machine has none and no network). The engine is the synthetic engine with its KV
cache held on the GPU the way vLLM holds one: at start it takes ``--fraction`` of GPU 0's memory as the
pool of its KV cache (what ``gpu_memory_utilization`` does), every generated token writes its slot, and
while any request runs a thread keeps the GPU busy with bf16 matmuls (a serving engine's steps). It
reports ``kv_cache_usage`` as vLLM does: tokens held by running requests over the pool's tokens, and it
pre-allocates, so ``pressureSignal: auto`` means ``kvCache``. Around it everything is the real runtime:
``RuntimeServer`` with the real NVML source (``NvmlSource``) sampling every 50 ms, the real
micro-scheduler with its default marks (low sheds at 0.92), HTTP/1.1 on loopback; and the node's
gossip (``GossipState``) with the map reader (``node_from_object``) on the server's own readings.

Steps: one low-priority probe on the idle engine; then high-priority streams (never shed), each
holding ``--prompt-words`` tokens, are opened one at a time, and after each the server's sample, one
low-priority probe and one gossip plan are taken. Checks (exit 1 if one fails, 2 without a GPU):
NVML reads ~``--fraction`` of the memory from the start and >= 0.5 utilisation while streams run, yet
the server's pressure equals the engine's KV-cache use (within 0.02), never NVML's memory fraction;
every probe below 0.92 KV is admitted and every probe at or above it refused with
``RESOURCE_EXHAUSTED``, and at least one of each was seen (a probe within its own 32 tokens below the mark
may go either way: the gate adds a new request's tokens to the last sample); the published map admits exactly while KV is
below 0.92 (and the node has not crossed it since, hysteresis) though utilisation is above 0.95; each
published GPU has a ``GPU-`` UUID, NVML's total memory, utilisation in [0, 1] and a power reading.
``--cpu`` runs the same steps on ``SimulatedGpuSource.under_vllm()`` with the pool in host memory:
a simulation, said so in its output; it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import threading
import time
from typing import Any

from zerolayer.gpumap import node_from_object
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.gossip.status import GossipSettings, GossipState, Load
from zerolayer.runtime.scheduler.api import TenantPolicy
from zerolayer.runtime.scheduler.config import SchedulerConfig
from zerolayer.runtime.scheduler.core import MicroScheduler
from zerolayer.runtime.serving.server import RuntimeServer
from zerolayer.runtime.tenants import Tenant, key_hash

KEY, SHED_AT = "device-check-key", SchedulerConfig().low_shed_at
PROBE_TOKENS = 32  # a low probe's rendered prompt and its one output token, with room to spare


class KvPool:
    """The engine's KV cache as vLLM keeps it: one allocation of ``fraction`` of the device, taken at start."""

    def __init__(self, device: str, fraction: float, tokens: int) -> None:
        import torch

        self.torch, self.device, self.tokens = torch, device, tokens
        n = 8192 if device == "cuda" else 64  # ~1 TFLOP a matmul: a step keeps an H200 busy for milliseconds
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.a @ self.b  # cuBLAS's workspace is allocated before the pool, as vLLM profiles before it allocates
        if device == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            size = max(tokens, int(fraction * total) - (total - free))
        else:
            size = tokens * 64
        self.slot = size // tokens
        self.pool = torch.empty(tokens * self.slot, dtype=torch.uint8, device=device)
        self.busy = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._steps, name="kv-pool-steps", daemon=True).start()

    def write(self, token: int) -> None:
        start = (token % self.tokens) * self.slot
        self.pool[start:start + min(self.slot, 4096)].fill_(1)

    def _steps(self) -> None:
        while not self.closed.is_set():
            if not self.busy.wait(0.05):
                continue
            for _ in range(16):  # enqueued back to back, one sync: the GPU never waits on Python
                self.a @ self.b
            if self.device == "cuda":
                self.torch.cuda.synchronize()


class GpuKvEngine(SyntheticEngine):
    """The synthetic engine whose KV cache lives in a :class:`KvPool` (a stand-in for vLLM, named as one)."""

    kind = "synthetic-gpu-kv"
    preallocates_gpu_memory = True

    def __init__(self, pool: KvPool) -> None:
        super().__init__(("tiny",), output_tokens=4000, tokens_per_second=4.0, kv_capacity_tokens=pool.tokens)
        self.pool = pool
        self._written = 0

    async def generate(self, prompt, options, request_id, priority):  # type: ignore[no-untyped-def]
        self.pool.busy.set()
        try:
            async for delta in super().generate(prompt, options, request_id, priority):
                self._written += max(1, delta.token_count)
                self.pool.write(self._written)
                yield delta
        finally:
            if not self._held:
                self.pool.busy.clear()


def gpu_source(cpu: bool, fraction: float) -> tuple[Any, str]:
    """The real NVML source on CUDA device 0's GPU, or the simulated double with ``cpu``."""
    if cpu:
        from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

        return SimulatedGpuSource.under_vllm(gpu_memory_utilization=fraction), "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(2)
    from zerolayer.runtime.gpu.nvml import NvmlSource

    probe = NvmlSource()
    cuda_uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")).lower()
    index = next((r.index for r in probe.sample() if cuda_uuid and cuda_uuid in r.uuid.lower()), 0)
    probe.close()
    return NvmlSource([index]), "cuda"


def post(port: int, priority: str, words: int, max_tokens: int) -> tuple[int, dict[str, str], http.client.HTTPConnection]:
    """Open one Anthropic Messages request; returns (status, headers, connection still streaming)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": " ".join(["kv"] * words)}]}
    conn.request("POST", "/v1/messages", json.dumps(body), {
        "content-type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01",
        "x-anthropic-priority": priority})
    response = conn.getresponse()
    headers = {k.lower(): v for k, v in response.getheaders()}
    if response.status != 200:
        response.read()
    else:
        response.readline()  # the first SSE line: the stream is open and admitted
    conn._zl_response = response  # type: ignore[attr-defined]
    return response.status, headers, conn


def probe(port: int) -> dict[str, Any]:
    status, headers, conn = post(port, "low", 3, 1)
    if status == 200:
        conn._zl_response.read()  # type: ignore[attr-defined]
    conn.close()
    return {"status": status, "code": headers.get("x-zerolayer-error", "")}


def step_record(server: RuntimeServer, engine: GpuKvEngine, state: GossipState, holders: int,
                wall: float) -> dict[str, Any]:
    """After one server sample: its pressure, the engine's KV use, one low probe and one gossip plan."""
    asyncio.run_coroutine_threadsafe(server.sample_once(), server_loop).result(30)
    pressure = server.last_pressure.memory_fraction if server.last_pressure is not None else None
    stats = engine.stats()
    result = probe(server.port)
    readings = server.gpu_source.sample()
    plan = state.plan(readings, Load(stats.running, stats.waiting, stats.kv_cache_usage), 100.0 * (holders + 1), wall)
    if plan is not None:
        state.published(plan, 100.0 * (holders + 1))
    status = state.last_status or {}
    node = node_from_object({"metadata": {"name": "device"}, "spec": {"nodeName": "device"}, "status": status},
                            now=wall)
    r = readings[0]
    return {"holders": holders, "kv": round(stats.kv_cache_usage, 4),
            "pressure": None if pressure is None else round(pressure, 4), "probe": result,
            "nvml_memory": round(r.memory_fraction, 4), "nvml_util": round(r.utilization, 3),
            "power_w": r.power_watts, "map_admits": node.admitting, "gpu": status["gpus"][0],
            "signal": status.get("pressureSignal")}


server_loop: asyncio.AbstractEventLoop


def run(args: argparse.Namespace) -> dict[str, Any]:
    global server_loop
    source, device = gpu_source(args.cpu, args.fraction)
    pool = KvPool(device, args.fraction, args.kv_tokens)
    engine = GpuKvEngine(pool)
    tenant = Tenant("t1", frozenset({key_hash(KEY)}), TenantPolicy("t1"))
    server = RuntimeServer(engine=engine, scheduler=MicroScheduler(SchedulerConfig()), tenants=[tenant], port=0,
                           gpu_source=source, sample_interval_s=0.05)
    server_loop = asyncio.new_event_loop()
    threading.Thread(target=server_loop.run_forever, name="runtime", daemon=True).start()
    asyncio.run_coroutine_threadsafe(server.start(), server_loop).result(60)
    state = GossipState(GossipSettings(), endpoint=f"http://127.0.0.1:{server.port}", engine_preallocates=True)
    steps, holders, wall = [], [], time.time()
    try:
        steps.append(step_record(server, engine, state, 0, wall))
        while len(holders) < args.max_holders and engine.stats().kv_cache_usage < args.stop_at:
            status, _, conn = post(server.port, "high", args.prompt_words, 4000)
            if status != 200:
                raise SystemExit(f"a high-priority stream was refused ({status}): high is never shed")
            holders.append(conn)
            time.sleep(args.dwell)  # NVML's utilisation is a busy fraction over its last sample period (up to 1 s)
            steps.append(step_record(server, engine, state, len(holders), wall))
    finally:
        for conn in holders:
            conn.close()
        asyncio.run_coroutine_threadsafe(server.stop(), server_loop).result(60)
        pool.closed.set()
        source.close()
    return {"device": device, "fraction": args.fraction, "kv_tokens": args.kv_tokens, "steps": steps}


def check(result: dict[str, Any], fraction: float) -> list[str]:
    """What must hold (see the module docstring); one line per failure."""
    problems, steps = [], result["steps"]
    crossed = False
    for st in steps:
        where = f"{st['holders']} streams, kv {st['kv']}"
        crossed = crossed or st["kv"] >= SHED_AT
        if st["pressure"] is None or abs(st["pressure"] - st["kv"]) > 0.02:
            problems.append(f"{where}: the server's pressure {st['pressure']} does not follow the KV cache")
        if abs(st["nvml_memory"] - fraction) > 0.05:
            problems.append(f"{where}: NVML memory {st['nvml_memory']} is not the pre-allocated {fraction}")
        admitted = st["probe"]["status"] == 200
        # The gate projects a new request's own tokens onto the last sample: a probe within that
        # many tokens of the mark may go either way.
        near = SHED_AT - PROBE_TOKENS / result["kv_tokens"] <= st["kv"] < SHED_AT
        if not near and admitted == (st["kv"] >= SHED_AT):
            problems.append(f"{where}: low probe {st['probe']} at the {SHED_AT} mark")
        if not admitted and st["probe"]["code"] != "RESOURCE_EXHAUSTED":
            problems.append(f"{where}: refused with {st['probe']['code']!r}, not RESOURCE_EXHAUSTED")
        if st["map_admits"] == crossed:
            problems.append(f"{where}: the map says admitting={st['map_admits']} after crossing={crossed}")
        problems += [f"{where}: published GPU {g}" for g in [st["gpu"]] if not gpu_sane(g)]
    busy = [st for st in steps if st["holders"]]
    if busy and max(st["nvml_util"] for st in busy) < 0.5:
        problems.append("NVML utilisation stayed below 0.5 while streams ran: the GPU was not busy")
    if not any(st["probe"]["status"] == 200 for st in steps) or not any(st["probe"]["status"] != 200 for st in steps):
        problems.append("the probes did not see both sides of the mark (raise --max-holders or --stop-at)")
    return problems


def gpu_sane(gpu: dict[str, Any]) -> bool:
    return (str(gpu.get("uuid", "")).startswith(("GPU-", "SIM-GPU-")) and gpu.get("memoryTotalBytes", 0) > 0
            and 0 <= gpu.get("memoryUsedBytes", -1) <= gpu["memoryTotalBytes"]
            and 0.0 <= gpu.get("utilization", -1) <= 1.0 and (gpu.get("powerWatts") or 0) > 0)


def report(result: dict[str, Any], problems: list[str]) -> None:
    print(f"{'streams':>7} {'kv':>6} {'pressure':>8} {'NVML mem':>8} {'NVML util':>9} {'power W':>8} "
          f"{'low probe':>10} {'map admits':>10}")
    for st in result["steps"]:
        probe_seen = "admitted" if st["probe"]["status"] == 200 else st["probe"]["code"][:10] or st["probe"]["status"]
        print(f"{st['holders']:>7} {st['kv']:>6.3f} {str(st['pressure']):>8} {st['nvml_memory']:>8.3f} "
              f"{st['nvml_util']:>9.3f} {str(st['power_w']):>8} {str(probe_seen):>10} {str(st['map_admits']):>10}")
    for line in problems:
        print(f"PROBLEM: {line}")
    simulated = " (SIMULATED: SimulatedGpuSource.under_vllm and a host-memory pool, not a GPU)" \
        if result["device"] == "cpu" else ""
    print("gpu_kv_pressure_check:", "FAILED" if problems else "ok", simulated)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: the simulated NVML double, pool in host memory")
    parser.add_argument("--fraction", type=float, default=0.9, help="GPU memory the engine takes (vLLM's 0.9)")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="tokens the KV pool holds")
    parser.add_argument("--prompt-words", type=int, default=160, help="tokens each high-priority stream holds")
    parser.add_argument("--max-holders", type=int, default=40)
    parser.add_argument("--stop-at", type=float, default=0.97, help="stop opening streams at this KV use")
    parser.add_argument("--dwell", type=float, default=None,
                        help="seconds of serving before each reading (default 1.0 on a GPU, 0 with --cpu)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.dwell is None:
        args.dwell = 0.0 if args.cpu else 1.0
    try:
        result = run(args)
    except SystemExit as exc:
        if exc.code == 2:
            print("gpu_kv_pressure_check: no CUDA GPU here; --cpu checks the script on the double", file=sys.stderr)
        raise
    problems = check(result, args.fraction)
    report(result, problems)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**result, "problems": problems}, out, indent=2, default=str)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
