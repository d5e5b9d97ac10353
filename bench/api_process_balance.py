"""How API processes share a few HTTP/2 clients: the kernel's SO_REUSEPORT hash against exact balance.

An HTTP/2 client sends all its requests on one connection, so with a handful of clients the process
each connection lands on decides how the work is spread (docs/api-processes.md, "Connection
balance"). Each trial opens fresh connections with h2load (``-c 2 -m 32`` by default: two clients,
each a single connection with 32 streams in flight) against, side by side, rows interleaved:

  1 process        the runtime with ``server.api_processes: 1``: the simple thing
  2, kernel        ``api_processes: 2``, ``server.connection_balance: kernel`` (SO_REUSEPORT's hash)
  2, exact         ``api_processes: 2``, ``connection_balance: exact`` (the parent hands each connection
                   to the process with the fewest open ones; the default)

The synthetic engine (16 tokens, no pacing), API-key auth, a tenant with quotas, two-stage admission.
Per trial: answered req/s, and each process's share of the requests (from the parent's merged
``--metrics-port`` page, ``zerolayer_requests_total`` by ``api_process``). The table gives the median
and the worst req/s over the trials, how many trials put every connection on one process, and the
busiest process's mean share. The load generator shares the machine's cores with the servers.

    python bench/api_process_balance.py [--trials 8] [-n 6000] [--clients 2] [--streams 32] [--save]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import httpx

import benchlib

ROWS = (("1 process", 1, "exact"), ("2, kernel", 2, "kernel"), ("2, exact", 2, "exact"))


def per_process(metrics_port: int) -> dict[str, float]:
    """Answered chat requests per API process, from the merged metrics page."""
    page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("zerolayer_requests_total{") and 'route="chat"' in line and 'status="200"' in line:
            index = line.split('api_process="')[1].split('"')[0] if 'api_process="' in line else "0"
            counts[index] = counts.get(index, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def start(processes: int, balance: str) -> tuple[list[str], dict[str, str], int, int, str]:
    port, metrics_port = benchlib.free_port(), benchlib.free_port()
    engine = {"kind": "synthetic", "models": ["synthetic"], "output_tokens": 16}
    config = benchlib.write_config(benchlib.runtime_config(
        port, engine, server={"api_processes": processes, "connection_balance": balance}))
    cmd = benchlib.runtime_cmd(config, "--metrics-port", str(metrics_port))
    return cmd, {"BENCH_KEY": benchlib.KEY}, port, metrics_port, config


def trial(port: int, metrics_port: int, processes: int, args: argparse.Namespace) -> dict[str, Any]:
    before = per_process(metrics_port)
    run = benchlib.h2load(f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}", n=args.n, clients=args.clients,
                          streams=args.streams)
    time.sleep(0.3)  # the processes' counters reach the merged page
    after = per_process(metrics_port)
    served = [after.get(str(i), 0.0) - before.get(str(i), 0.0) for i in range(processes)]
    total = sum(served) or 1.0
    return {"rps": run["rps"], "p99_ms": run["p99_ms"], "shares": [s / total for s in served],
            "command": run["command"]}


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in ROWS}
    servers = []
    try:
        for name, processes, balance in ROWS:  # all three up at once; trials interleave the rows
            cmd, env, port, metrics_port, config = start(processes, balance)
            context = benchlib.server(cmd, port, env=env)
            context.__enter__()
            servers.append((name, processes, port, metrics_port, config, context))
        for _, _, port, _, _, _ in servers:  # warm-up: every process has served before the trials
            benchlib.h2load(f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}", n=1000, clients=8, streams=8)
        for t in range(args.trials):
            for name, processes, port, metrics_port, _, _ in servers:
                results[name].append(trial(port, metrics_port, processes, args))
                row = results[name][-1]
                print(f"trial {t + 1} {name}: {row['rps']:.0f} req/s, shares "
                      + " / ".join(f"{s:.2f}" for s in row["shares"]), file=sys.stderr, flush=True)
    finally:
        for *_, config, context in servers:
            context.__exit__(None, None, None)
            os.unlink(config)
    return results


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    base = statistics.median(r["rps"] for r in results["1 process"])
    lines = [f"API processes and {args.clients} HTTP/2 client(s) of one connection each (h2load -c {args.clients} "
             f"-m {args.streams} -n {args.n}, fresh connections per trial), {args.trials} trials, rows interleaved",
             benchlib.machine_line(), "",
             f"{'row':<11} {'median req/s':>12} {'worst req/s':>11} {'vs 1 process':>12} {'p99 ms':>7} "
             f"{'all on one':>10} {'busiest share':>13}"]
    for name, _, _ in ROWS:
        rows = results[name]
        rps = [r["rps"] for r in rows]
        one = sum(1 for r in rows if max(r["shares"]) > 0.99) if len(rows[0]["shares"]) > 1 else None
        busiest = statistics.fmean(max(r["shares"]) for r in rows)
        lines.append(f"{name:<11} {statistics.median(rps):>12.0f} {min(rps):>11.0f} "
                     f"{benchlib.ratio(statistics.median(rps), base):>12} "
                     f"{statistics.median(r['p99_ms'] for r in rows):>7.1f} "
                     f"{'-' if one is None else f'{one}/{len(rows)}':>10} {busiest:>13.2f}")
    kernel = statistics.median(r["rps"] for r in results["2, kernel"])
    exact = statistics.median(r["rps"] for r in results["2, exact"])
    lines += ["", f"exact / kernel, median req/s: {benchlib.ratio(exact, kernel)}; "
              f"worst trial: {benchlib.ratio(min(r['rps'] for r in results['2, exact']), min(r['rps'] for r in results['2, kernel']))}",
              f"command: {benchlib.bench_argv()}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("-n", type=int, default=6000, help="requests per trial")
    parser.add_argument("--clients", type=int, default=2, help="HTTP/2 connections per trial")
    parser.add_argument("--streams", type=int, default=32, help="streams in flight per connection")
    parser.add_argument("--save", action="store_true", help="write bench/results/api_process_balance.{txt,json}")
    args = parser.parse_args()
    results = measure(args)
    text = report(results, args)
    print(text)
    if args.save:
        benchlib.save("api_process_balance", text, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
