"""Throughput against the number of server processes on one port (SO_REUSEPORT), on this machine.

h2load (``-c 8 -m 16``: eight connections, so the kernel's SO_REUSEPORT hashing can spread
them over the processes) against:

  bare-h2     bench/bare_h2.py with 1 and 2 processes (``--workers``);
  granian     granian's RSGI floor app with 1 and 2 workers;
  zerolayer   the runtime (synthetic engine, auth, quotas, admission) with 1 process and, when
              the runtime has a reuse-port option (``--reuse-port`` or ``listen.reuse_port``),
              2 processes started side by side on the same port. Each process then has its
              own scheduler and quota ledger: see docs/benchmarks.md for what that means.

The load generator runs on the same cores as the servers (one h2load thread), so on a 2-core
machine two server processes can never reach 2x: the ratio is what this box shows, not a law.

    python bench/multicore.py [-n 20000] [--processes 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

import benchlib
import granian_core
import serving_floor
from serving_floor import H2


def reuse_port_mode() -> str | None:
    """How this runtime shares a port: ``flag`` (--reuse-port), ``config`` (listen.reuse_port) or None."""
    help_text = subprocess.run([sys.executable, "-m", "zerolayer.cli", "runtime", "--help"], capture_output=True,
                               text=True, cwd=benchlib.HERE).stdout
    if "--reuse-port" in help_text:
        return "flag"
    if "reuse_port" in help_text:
        return "config"
    return None


@contextlib.contextmanager
def runtimes(port: int, count: int, mode: str | None) -> Iterator[list[int]]:
    """``count`` runtime processes on ``port``; yields their pids."""
    listen_extra = {"reuse_port": True} if mode == "config" and count > 1 else {}
    config = benchlib.runtime_config(port)
    config["listen"].update(listen_extra)
    path = benchlib.write_config(config)
    flags = ["--reuse-port"] if mode == "flag" and count > 1 else []
    try:
        with contextlib.ExitStack() as stack:
            pids = [stack.enter_context(benchlib.server(benchlib.runtime_cmd(path, *flags), port,
                                                        env={"BENCH_KEY": benchlib.KEY})).pid
                    for _ in range(count)]
            if count > 1:
                # The port already answers once the first process listens: give the others time to bind.
                time.sleep(5)
            yield pids
    finally:
        os.unlink(path)


def measure_pids(port: int, pids: list[int], n: int) -> dict:
    url = f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}"
    benchlib.h2load(url, n=max(1000, n // 10), **H2)
    meters = [benchlib.CpuMeter(p) for p in pids]
    for m in meters:
        m.start()
    result = benchlib.h2load(url, n=n, **H2)
    cpu = sum(m.stop() for m in meters)
    result["server_cpu_s"] = cpu
    result["cpu_ms_per_req"] = cpu * 1000 / result["ok"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--name", default="multicore")
    args = parser.parse_args()
    mode = reuse_port_mode()
    rows: dict[str, dict[int, dict]] = {"bare-h2": {}, "granian": {}, "zerolayer": {}}
    for count in args.processes:
        port = benchlib.free_port()
        with benchlib.server(serving_floor.bare_cmd(port, count), port) as proc:
            rows["bare-h2"][count] = measure_pids(port, [proc.pid], args.n)
        port = benchlib.free_port()
        cmd = granian_core.granian_cmd(port, "2", workers=count)
        with benchlib.server(cmd, port) as proc:
            rows["granian"][count] = measure_pids(port, [proc.pid], args.n)
        if count == 1 or mode is not None:
            port = benchlib.free_port()
            with runtimes(port, count, mode) as pids:
                rows["zerolayer"][count] = measure_pids(port, pids, args.n)
        print(f"{count} process(es) done", file=sys.stderr, flush=True)
    rev = os.environ.get("ZEROLAYER_BENCH_REV", "working tree")
    lines = [
        f"multi-core: req/s against server processes sharing one port (SO_REUSEPORT); h2load -n {args.n} "
        f"-c {H2['clients']} -m {H2['streams']}, non-streaming POST {benchlib.CHAT_PATH}; runtime at {rev}",
        benchlib.machine_line(),
        "",
        f"{'server':<10} {'procs':>5} {'req/s':>8} {'p99 ms':>8} {'CPU ms/req':>10} {'scaling vs 1':>12}",
    ]
    for server, by_count in rows.items():
        for count, r in by_count.items():
            one = by_count.get(1)
            lines.append(f"{server:<10} {count:>5} {r['rps']:8.0f} {r['p99_ms']:8.2f} {r['cpu_ms_per_req']:10.3f} "
                         f"{benchlib.ratio(r['rps'], one['rps'] if one else None):>12}")
    if mode is None:
        lines += ["", "zerolayer: this runtime has no reuse-port option (neither --reuse-port nor listen.reuse_port "
                      "in `zerolayer runtime --help`), so only one process was measured."]
    else:
        lines += ["", f"zerolayer: processes share the port through the runtime's reuse-port option ({mode}); each "
                      "has its own engine, scheduler and quota ledger."]
    text = "\n".join(lines)
    print(text)
    benchlib.save(args.name, text, {"rows": rows, "reuse_port_mode": mode, "command": benchlib.bench_argv(),
                                    "runtime_rev": rev})
    plt = benchlib.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for server, by_count in rows.items():
            if by_count:
                ax.plot(list(by_count), [r["rps"] for r in by_count.values()], marker="o", label=server)
        ax.set_xlabel("server processes (SO_REUSEPORT)")
        ax.set_ylabel("requests/s (h2load)")
        ax.set_xticks(args.processes)
        ax.legend()
        ax.set_title("scaling with processes on 2 shared cores")
        fig.tight_layout()
        fig.savefig(benchlib.RESULTS / f"{args.name}.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
