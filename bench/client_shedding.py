"""Client retries under shedding, and the SDK's HTTP/2 path against the official SDK.

    python bench/client_shedding.py [--requests 600] [--workers 12] [--kv-capacity 110]

Table 1 runs the same low-priority load against one real runtime (synthetic engine) whose
modelled KV cache is small enough that memory-pressure shedding refuses part of the
first attempts, once per client configuration. Comparison: ``no retries``. Columns: share
of requests refused at least once, retry success (refused requests that still succeeded),
overall success, attempts the server saw per request, p50/p99 latency as a ratio of the
no-retry row.

Table 2 times the same concurrent unary load through ``zerolayer.client.AsyncClient``
(HTTP/2, one connection) and the official ``anthropic.AsyncAnthropic`` (HTTP/1.1 pool).
Comparison: the official SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import pathlib
import statistics
import subprocess
import sys
import time

import httpx

from zerolayer.client import AsyncClient, RetryBudget, RetryPolicy, ZerolayerError
from zerolayer.client.events import RetryScheduled

NODE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "integration" / "client" / "runtime_node.py"
KEY = "tenant-key"


def start_node(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(NODE), *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise SystemExit(f"runtime did not start: {line!r}")
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def stop_node(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)
    proc.stdout.close()


def server_attempts(url: str) -> int:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("zerolayer_requests_total") and 'route="messages"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def shedding_run(url: str, name: str, policy: RetryPolicy, budget: RetryBudget, requests: int, workers: int):
    current: contextvars.ContextVar[list] = contextvars.ContextVar("current")
    before = server_attempts(url)
    outcomes: list[tuple[bool, bool, float]] = []

    def listener(event):
        if isinstance(event, RetryScheduled):
            current.get().append(event)

    async with AsyncClient(api_key=KEY, base_url=url, priority="low", retry_policy=policy, retry_budget=budget,
                           on_event=listener) as client:  # fmt: skip

        async def worker(w: int) -> None:
            for i in range(requests // workers):
                retries: list = []
                current.set(retries)
                start = time.perf_counter()
                try:
                    await client.messages.create(model="tiny", max_tokens=8,
                                                 messages=[{"role": "user", "content": f"q {w} {i}"}])  # fmt: skip
                    ok = True
                except ZerolayerError:
                    ok = False
                outcomes.append((bool(retries) or not ok, ok, time.perf_counter() - start))

        await asyncio.gather(*(worker(w) for w in range(workers)))
    n = len(outcomes)
    refused = [ok for r, ok, _ in outcomes if r]
    lat = sorted(t for *_, t in outcomes)
    return {
        "name": name,
        "refused": len(refused) / n,
        "retry_success": (sum(refused) / len(refused)) if refused else float("nan"),
        "success": sum(ok for _, ok, _ in outcomes) / n,
        "attempts": (server_attempts(url) - before) / n,
        "p50": statistics.median(lat),
        "p99": lat[int(0.99 * (n - 1))],
    }


async def protocol_run(url: str, requests: int, workers: int) -> dict[str, float]:
    import anthropic

    msgs = [{"role": "user", "content": "hello"}]
    out = {}
    async with AsyncClient(api_key=KEY, base_url=url) as ours:
        official = anthropic.AsyncAnthropic(api_key=KEY, base_url=url, max_retries=0)
        for name, call in (
            ("anthropic SDK (HTTP/1.1)", lambda: official.messages.create(model="tiny", max_tokens=8, messages=msgs)),
            ("zerolayer.client (HTTP/2)", lambda: ours.messages.create(model="tiny", max_tokens=8, messages=msgs)),
        ):
            await call()  # warm the connection(s)

            async def worker() -> None:
                for _ in range(requests // workers):
                    await call()

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(workers)))
            out[name] = time.perf_counter() - start
        await official.close()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--kv-capacity", type=int, default=110)
    args = parser.parse_args()

    proc, url = start_node("--tps", "200", "--output-tokens", "8", "--kv-capacity", str(args.kv_capacity),
                           "--retry-after", "0.05")  # fmt: skip
    try:
        configs = [
            ("no retries", RetryPolicy(max_retries=0), RetryBudget()),
            ("reference policy, budget 1.2x", RetryPolicy(max_retries=5, max_delay_s=1.0), RetryBudget(0.2, 10)),
            ("reference policy, budget 1.5x", RetryPolicy(max_retries=5, max_delay_s=1.0), RetryBudget(0.5, 10)),
            ("reference policy, no budget", RetryPolicy(max_retries=5, max_delay_s=1.0), RetryBudget(100, 1e9)),
        ]
        rows = [await shedding_run(url, n, p, b, args.requests, args.workers) for n, p, b in configs]
    finally:
        stop_node(proc)
    base = rows[0]
    print(f"\nShedding: {args.requests} low-priority requests, {args.workers} concurrent, kv capacity {args.kv_capacity}"
          " tokens (comparison: no retries)")  # fmt: skip
    print(f"{'client':32} {'refused':>8} {'retry ok':>9} {'success':>8} {'attempts/req':>13} {'p50 x':>6} {'p99 x':>6}")
    for r in rows:
        print(f"{r['name']:32} {r['refused']:8.1%} {r['retry_success']:9.1%} {r['success']:8.1%} "
              f"{r['attempts']:13.2f} {r['p50'] / base['p50']:6.2f} {r['p99'] / base['p99']:6.2f}")  # fmt: skip

    proc, url = start_node("--output-tokens", "8")
    try:
        times = await protocol_run(url, args.requests, args.workers)
    finally:
        stop_node(proc)
    ref = times["anthropic SDK (HTTP/1.1)"]
    print(f"\nProtocol: {args.requests} unary requests, {args.workers} concurrent (comparison: the official SDK)")
    print(f"{'client':28} {'wall s':>7} {'ratio':>6}")
    for name, t in times.items():
        print(f"{name:28} {t:7.2f} {t / ref:6.2f}")


if __name__ == "__main__":
    asyncio.run(main())
