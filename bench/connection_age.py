"""Pinned HTTP/2 clients after scale-out: ``server.max_connection_age_s`` off against on.

A plain HTTP/2 client keeps one connection for as long as it lives, so behind a Kubernetes Service (an
L4 balancer that places connections, not requests) it stays on the node it reached first, even after a
second node joins. ``server.max_connection_age_s`` drains connections by age, so the next connection is
placed again (docs/runtime.md, "Connection age"). Each trial, rows interleaved:

- Nodes A and B: two runtimes (synthetic engine, 16 tokens, API-key auth, a tenant with quotas).
- The Service: a round-robin TCP proxy in this process that places each new connection on the next
  ready backend, as kube-proxy's IPVS ``rr`` mode does. It is written here because the bench must
  change the backend set mid-run; kube-proxy needs a cluster.
- Clients: ``--clients`` httpx clients (HTTP/2 prior knowledge, one connection each, as the official
  Python SDKs with ``http2=True``) send chat completions back to back.
- Timeline: only A is a backend at first. B joins at ``--join-s`` (a new pod turning Ready), and the
  run ends at ``--duration-s``.

Reported per row: the share of requests B answered after it joined (each node's
``zerolayer_requests_total`` from its ``--metrics-port``), requests/s, the client errors (a stream
refused on a draining connection surfaces in httpx as an error; the row retries it), and the
client-side p99. The simple thing is the row with the age off: B gets nothing.

    python bench/connection_age.py [--trials 2] [--clients 8] [--age-s 2] [--join-s 3] [--duration-s 15] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import httpx

import benchlib

BODY = json.loads(benchlib.CHAT_BODY)


class RoundRobinService:
    """An L4 proxy: each accepted connection goes to the next backend port, bytes copied both ways."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self.placed = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self.backends[self.placed % len(self.backends)]
        self.placed += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # the run is over: asyncio.run cancels the connections still open


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def answered(metrics_port: int) -> float:
    page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("zerolayer_requests_total{") and 'route="chat"' in line and 'status="200"' in line)


async def client_loop(url: str, stop: float, latencies: list[float], errors: list[str]) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    headers = {"authorization": f"Bearer {benchlib.KEY}"}
    async with httpx.AsyncClient(http1=False, http2=True, limits=limits, timeout=30) as client:
        while time.monotonic() < stop:
            started = time.monotonic()
            try:
                response = await client.post(url, json=BODY, headers=headers)
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                continue
            if response.status_code != 200:
                errors.append(str(response.status_code))
                continue
            latencies.append(time.monotonic() - started)


async def drive(nodes: list[tuple[int, int]], args: argparse.Namespace) -> dict[str, Any]:
    (port_a, metrics_a), (port_b, metrics_b) = nodes
    service = RoundRobinService([port_a])
    server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}{benchlib.CHAT_PATH}"
    latencies: list[float] = []
    errors: list[str] = []
    start = time.monotonic()
    clients = [asyncio.create_task(client_loop(url, start + args.duration_s, latencies, errors))
               for _ in range(args.clients)]
    await asyncio.sleep(args.join_s)
    joined_a, joined_b = answered(metrics_a), answered(metrics_b)
    service.backends.append(port_b)  # B turns Ready: new connections go round A and B
    await asyncio.gather(*clients)
    end_a, end_b = answered(metrics_a), answered(metrics_b)
    server.close()
    after = (end_a - joined_a) + (end_b - joined_b)
    return {"b_share": (end_b - joined_b) / after if after else 0.0, "rps": len(latencies) / args.duration_s,
            "errors": len(errors), "error_kinds": sorted(set(errors)), "connections": service.placed,
            "p99_ms": statistics.quantiles(latencies, n=100)[98] * 1000 if len(latencies) > 100 else None}


def trial(age_s: float | None, args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        nodes = []
        for _ in range(2):
            port, metrics_port = benchlib.free_port(), benchlib.free_port()
            server = {"max_connection_age_s": age_s} if age_s else {}
            engine = {"kind": "synthetic", "models": ["synthetic"], "output_tokens": 16}
            config = benchlib.write_config(benchlib.runtime_config(port, engine, server=server))
            cmd = benchlib.runtime_cmd(config, "--metrics-port", str(metrics_port))
            stack.enter_context(benchlib.server(cmd, port, env={"BENCH_KEY": benchlib.KEY}))
            nodes.append((port, metrics_port))
        return asyncio.run(drive(nodes, args))


def report(rows: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [f"{args.clients} HTTP/2 clients (httpx, one connection each) through a round-robin L4 proxy; node B "
             f"joins at {args.join_s:g} s of {args.duration_s:g} s; synthetic engine; medians of {args.trials} "
             "interleaved trials", f"command: python bench/connection_age.py {' '.join(sys.argv[1:])}", "",
             f"{'row':<14} {'B share after join':>18} {'req/s':>7} {'client errors':>13} {'connections':>11} "
             f"{'p99 ms':>7}"]
    for name, runs in rows.items():
        p99s = [r["p99_ms"] for r in runs if r["p99_ms"] is not None]
        lines.append(f"{name:<14} {statistics.median(r['b_share'] for r in runs):>18.2f} "
                     f"{statistics.median(r['rps'] for r in runs):>7.0f} "
                     f"{statistics.median(r['errors'] for r in runs):>13.0f} "
                     f"{statistics.median(r['connections'] for r in runs):>11.0f} "
                     f"{statistics.median(p99s) if p99s else float('nan'):>7.1f}")
    kinds = sorted({k for runs in rows.values() for r in runs for k in r["error_kinds"]})
    lines += ["", f"per trial B share: " + "; ".join(f"{n}: " + ", ".join(f"{r['b_share']:.2f}" for r in runs)
                                                   for n, runs in rows.items()),
              f"client error kinds: {', '.join(kinds) or 'none'}",
              "an even spread is 0.50; B answers nothing while every client stays on the connection it opened to A"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--age-s", type=float, default=2.0)
    parser.add_argument("--join-s", type=float, default=3.0)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--save", action="store_true", help="write bench/results/connection_age.txt")
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"age off": [], f"age {args.age_s:g} s": []}
    for _ in range(args.trials):
        for name, age in (("age off", None), (f"age {args.age_s:g} s", args.age_s)):
            rows[name].append(trial(age, args))
            print(f"{name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    text = report(rows, args)
    print(text)
    if args.save:
        (benchlib.HERE / "results" / "connection_age.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
