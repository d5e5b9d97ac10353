"""What the serving path costs: zerolayer over HTTP/2 against a direct call and a middle layer.

Same synthetic engine (16 output tokens, no pacing: pure protocol and scheduling cost),
same non-streaming Anthropic Messages request, three paths:

  (a) direct  — the engine called in-process: render + generate, no network at all;
  (b) zerolayer — ``zerolayer runtime`` (HTTP/2 prior knowledge, scheduler admitting at
      HEADERS and body, engine in the same process), one client connection;
  (c) proxy   — a FastAPI/uvicorn gateway forwarding with httpx to a FastAPI/uvicorn model
      server running the same engine (the LiteLLM-in-front-of-vLLM shape; LiteLLM itself is
      not installable here), HTTP/1.1 keep-alive connections;
  (b') zerolayer-h1 — path (b) through the same HTTP/1.1 client pool as (c), so client cost is equal.

Latency: sequential requests, client-side wall time; "added" is the path's median/p99 minus
the direct call's. Throughput: ``--concurrency`` requests in flight, requests/s overall and
per CPU-second of the server processes (all of them: the proxy path has two). Each server
runs in its own process; this machine has 2 cores shared with the load generator, so read
the ratios, not the absolute numbers.

    python bench/runtime_overhead.py [--requests 400] [--throughput-requests 2000] [--concurrency 32]
    python bench/runtime_overhead.py --engine vllm --requests 100 --throughput-requests 400 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from benchlib import cpu_seconds  # bench/ is on sys.path when run as a script

HERE = pathlib.Path(__file__).resolve().parent
KEY = "sk-bench"
# temperature 0: greedy decoding, so the real engine gives every path the same answer length.
BODY = json.dumps({"model": "synthetic", "max_tokens": 16, "temperature": 0,
                   "messages": [{"role": "user", "content": "what does a zero layer cost?"}]}).encode()
TINY_MODEL = HERE.parent / ".models" / "tiny-llama"
ENGINE = "synthetic"  # set from --engine
HEADERS = {"x-api-key": KEY, "content-type": "application/json", "x-zerolayer-priority": "normal"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (vLLM's engine-core and worker processes)."""
    parents: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(parents.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(parents.get(child, ()))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --------------------------------------------------------------------------- paths
async def direct(n_latency: int, n_throughput: int, concurrency: int) -> dict:
    from zerolayer.runtime.api import anthropic
    from zerolayer.runtime.api.common import dumps
    from zerolayer.runtime.engine.base import SamplingOptions
    from zerolayer.runtime.engine.synthetic import SyntheticEngine

    if ENGINE == "vllm":
        from zerolayer.runtime.engine.vllm_engine import VllmEngine

        engine = VllmEngine(str(TINY_MODEL), served_name="synthetic", max_model_len=1024, max_num_seqs=16,
                            kv_cache_memory_bytes=64 * 1024 * 1024, enforce_eager=True, dtype="float32")
    else:
        engine = SyntheticEngine()
    await engine.start()
    ids = iter(range(10**9))

    async def call() -> None:
        req = anthropic.parse(BODY)
        prompt = await engine.render(req.model, req.messages)
        parts, tokens = [], 0
        options = SamplingOptions(req.max_tokens, temperature=req.temperature)
        async for delta in engine.generate(prompt, options, f"r{next(ids)}", 1):
            parts.append(delta.text)
            tokens += delta.token_count
        dumps(anthropic.message("m", req.model, "".join(parts), "end_turn",
                                {"input_tokens": prompt.token_count, "output_tokens": tokens}))

    try:
        # vLLM's engine core runs in child processes: count their CPU too.
        return await measure(call, n_latency, n_throughput, concurrency, pids=[os.getpid(), *children(os.getpid())])
    finally:
        await engine.close()


async def measure(call, n_latency: int, n_throughput: int, concurrency: int, pids: list[int]) -> dict:  # type: ignore[no-untyped-def]
    for _ in range(min(50, n_latency)):  # warm up connections and code paths
        await call()
    latencies = []
    for _ in range(n_latency):
        start = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - start)
    queue = iter(range(n_throughput))

    async def worker() -> None:
        for _ in queue:
            await call()

    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "rps": n_throughput / elapsed,
        "rps_per_cpu_s": n_throughput / cpu if cpu > 0 else float("nan"),
    }


def duration_ms(text: str) -> float:
    """h2load's durations: ``345us``, ``1.23ms``, ``1.2s``."""
    for unit, scale in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


async def h2load(url: str, *, http1: bool, n: int, concurrency: int, pids: list[int]) -> dict | None:
    """Throughput under nghttp2's h2load (a C load generator: no Python client cost), if installed.

    HTTP/2: one connection with ``concurrency`` streams in flight; HTTP/1.1: ``concurrency``
    keep-alive connections. Returns req/s, req per server CPU-second and the mean request time.
    """
    binary = shutil.which("h2load")
    if binary is None:
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(BODY)
    shape = ["--h1", "-c", str(concurrency), "-m", "1"] if http1 else ["-c", "1", "-m", str(concurrency)]
    cmd = [binary, "-n", str(n), *shape, "-d", f.name, "-H", f"x-api-key: {KEY}",
           "-H", "content-type: application/json", url]
    try:
        cpu0 = cpu_seconds(pids)
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out = (await proc.communicate())[0].decode()
        cpu = cpu_seconds(pids) - cpu0
    finally:
        os.unlink(f.name)
    done = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed", out)
    elapsed = re.search(r"finished in ([\d.]+\w+),", out)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out)
    if not (done and elapsed) or int(done.group(1)) == 0:
        raise RuntimeError(f"h2load failed:\n{out[-2000:]}")
    ok, failed = int(done.group(1)), int(done.group(2))
    # Only answered requests count: a path that drops requests under load is not credited for them.
    return {"rps": ok / (duration_ms(elapsed.group(1)) / 1000), "rps_per_cpu_s": ok / cpu if cpu > 0 else float("nan"),
            "mean_ms": duration_ms(mean.group(1)) if mean else float("nan"), "failed": failed}


async def wait_ready(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                await client.post(url, content=BODY, headers=HEADERS)
                return
            except httpx.TransportError:
                await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def zerolayer(n_latency: int, n_throughput: int, concurrency: int, http2: bool = True) -> dict:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "engine": {"kind": "synthetic", "models": ["synthetic"]} if ENGINE == "synthetic" else {
            "kind": "vllm", "model_path": str(TINY_MODEL), "served_name": "synthetic", "max_model_len": 1024,
            "max_num_seqs": 16, "kv_cache_memory_bytes": 64 * 1024 * 1024,
            "enforce_eager": True, "dtype": "float32"},
        "tenants": [{"name": "bench", "keys": [{"env": "BENCH_KEY"}]}],
        "limits": {"max_concurrent_streams": 1024},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)  # JSON is YAML
    proc = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", f.name,
                             "--log-level", "WARNING"], env={**os.environ, "BENCH_KEY": KEY},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/v1/messages"
        await wait_ready(url)
        if http2:  # one connection, every request a stream on it
            client = httpx.AsyncClient(http1=False, http2=True, timeout=30)
        else:  # the same keep-alive HTTP/1.1 pool the proxy path gets
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            client = httpx.AsyncClient(timeout=30, limits=limits)
        async with client:
            async def call() -> None:
                response = await client.post(url, content=BODY, headers=HEADERS)
                assert response.status_code == 200, response.text

            pids = [proc.pid, *children(proc.pid)]
            result = await measure(call, n_latency, n_throughput, concurrency, pids=pids)
        result["h2load"] = await h2load(url, http1=not http2, n=n_throughput * 2, concurrency=concurrency, pids=pids)
        return result
    finally:
        proc.terminate()
        proc.wait(30)
        os.unlink(f.name)


async def proxy(n_latency: int, n_throughput: int, concurrency: int) -> dict:
    engine_port, proxy_port = free_port(), free_port()
    env = {**os.environ, "BENCH_KEY": KEY, "BENCH_UPSTREAM": f"http://127.0.0.1:{engine_port}",
           "BENCH_ENGINE": ENGINE, "BENCH_MODEL": str(TINY_MODEL)}
    uvicorn = [sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "--log-level", "warning",
               "--no-access-log", "--host", "127.0.0.1"]
    procs = [subprocess.Popen([*uvicorn, "--port", str(engine_port), "runtime_baseline:engine_app"], env=env),
             subprocess.Popen([*uvicorn, "--port", str(proxy_port), "runtime_baseline:proxy_app"], env=env)]
    try:
        url = f"http://127.0.0.1:{proxy_port}/v1/messages"
        await wait_ready(f"http://127.0.0.1:{engine_port}/v1/messages")
        await wait_ready(url)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            async def call() -> None:
                response = await client.post(url, content=BODY, headers=HEADERS)
                assert response.status_code == 200, response.text

            pids = [pid for p in procs for pid in (p.pid, *children(p.pid))]
            result = await measure(call, n_latency, n_throughput, concurrency, pids=pids)
        result["h2load"] = await h2load(url, http1=True, n=n_throughput * 2, concurrency=concurrency, pids=pids)
        return result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


# --------------------------------------------------------------------------- report
def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    base = results["direct"]
    lines = [
        f"runtime overhead: {ENGINE} engine, 16 output tokens max, non-streaming /v1/messages; "
        f"latency over {args.requests} sequential requests, throughput over {args.throughput_requests} "
        f"requests at concurrency {args.concurrency}; {os.cpu_count()} CPUs shared with the load generator "
        f"(load average at the end: {os.getloadavg()[0]:.1f})",
        "",
        f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'req/s':>8} "
        f"{'req/cpu-s':>10}",
    ]
    for name, r in results.items():
        lines.append(f"{name:<12} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['p50_ms'] - base['p50_ms']:10.3f} "
                     f"{r['p99_ms'] - base['p99_ms']:10.3f} {r['rps']:8.0f} {r['rps_per_cpu_s']:10.0f}")
    p = results["proxy"]
    added = lambda r, k: r[k] - base[k]  # noqa: E731

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if a > 0 and b > 0 else "n/a"

    lines += ["", "ratios against the proxy (>1 = zerolayer better):"]
    for name in ("zerolayer", "zerolayer-h1"):
        z = results[name]
        lines.append(
            f"  {name:<13} added latency p50 {ratio(added(p, 'p50_ms'), added(z, 'p50_ms'))}, "
            f"p99 {ratio(added(p, 'p99_ms'), added(z, 'p99_ms'))}; "
            f"latency p50 {ratio(p['p50_ms'], z['p50_ms'])}, p99 {ratio(p['p99_ms'], z['p99_ms'])}; "
            f"req/s {ratio(z['rps'], p['rps'])}; "
            f"req per server CPU-second {ratio(z['rps_per_cpu_s'], p['rps_per_cpu_s'])}")
    loaded = {n: r.get("h2load") for n, r in results.items() if r.get("h2load")}
    if "proxy" in loaded and loaded:
        hp = loaded["proxy"]
        lines += ["", f"under h2load ({2 * args.throughput_requests} requests, {args.concurrency} in flight; "
                      "a C client, so the servers are the bottleneck):",
                  f"  {'path':<13} {'req/s':>8} {'req/cpu-s':>10} {'mean ms':>8} {'failed':>7}  "
                  "ratio vs proxy (req/s, req/cpu-s)"]
        for name, h in loaded.items():
            lines.append(f"  {name:<13} {h['rps']:8.0f} {h['rps_per_cpu_s']:10.0f} {h['mean_ms']:8.2f} "
                         f"{h.get('failed', 0):7d}  "
                         f"{ratio(h['rps'], hp['rps'])}, {ratio(h['rps_per_cpu_s'], hp['rps_per_cpu_s'])}")
    if min(added(results[n], "p50_ms") for n in results if n != "direct") <= 0:
        lines.append("  (added latency n/a: a path measured below the direct call. With vLLM the direct call shares")
        lines.append("   the load generator's process and GIL with the engine client, so compare absolute latency.)")
    lines += [
        "",
        "direct = engine called in-process (no network); zerolayer = zerolayer runtime over h2c, one connection",
        "(the Python h2 client is a large part of its latency); zerolayer-h1 = the same server through the same",
        "HTTP/1.1 keep-alive client pool as the proxy path, so the client's cost is equal;",
        "proxy = FastAPI/uvicorn gateway -> FastAPI/uvicorn model server (HTTP/1.1 keep-alive), same engine.",
    ]
    return "\n".join(lines)


def plot(results: dict[str, dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    base = results["direct"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    # Added latency when every path is above the direct call; absolute latency otherwise (engine-bound runs).
    absolute = any(results[n]["p50_ms"] <= base["p50_ms"] for n in names[1:])
    shown = names if absolute else names[1:]
    offset = {k: 0.0 if absolute else base[k] for k in ("p50_ms", "p99_ms")}
    xs = range(len(shown))
    ax1.bar([x - width / 2 for x in xs], [results[n]["p50_ms"] - offset["p50_ms"] for n in shown], width,
            label="p50")
    ax1.bar([x + width / 2 for x in xs], [results[n]["p99_ms"] - offset["p99_ms"] for n in shown], width,
            label="p99")
    ax1.set_xticks(list(xs), shown)
    ax1.set_ylabel("latency (ms)" if absolute else "added latency vs direct call (ms)")
    ax1.legend()
    ax2.bar(names[1:], [results[n]["rps_per_cpu_s"] for n in names[1:]],
            color=["tab:green", "tab:olive", "tab:red"][: len(names) - 1])
    ax2.set_ylabel("requests per server CPU-second")
    fig.suptitle(f"zerolayer runtime vs a FastAPI proxy in front of a model server ({ENGINE} engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests for latency")
    parser.add_argument("--throughput-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--engine", choices=("synthetic", "vllm"), default="synthetic",
                        help="vllm: the tiny generated model (python -m zerolayer.runtime.node.tinymodel) on vLLM")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    global ENGINE
    ENGINE = args.engine
    if ENGINE == "vllm":
        from zerolayer.runtime.node import tinymodel

        tinymodel.generate(TINY_MODEL)
    results = {}
    paths = (("direct", direct), ("zerolayer", zerolayer),
             ("zerolayer-h1", lambda *a: zerolayer(*a, http2=False)), ("proxy", proxy))
    for name, path in paths:
        results[name] = await path(args.requests, args.throughput_requests, args.concurrency)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    stem = "runtime_overhead" if ENGINE == "synthetic" else "runtime_overhead_vllm"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, args)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    plot(results, out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
