"""A Rust-backed server core (granian, on hyper) next to the runtime's sans-IO h2 core: speed, then fitness.

Part 1, speed: h2load with bench/serving_floor.py's settings against the same fixed chat
completion served by granian's native RSGI interface (bench/floor_apps.py:rsgi_app; one
worker, one runtime thread) over h2c and HTTP/1.1, next to bare_h2 (python-hyper h2 on
uvloop), uvicorn, and the zerolayer runtime. Ratios are granian ÷ bare_h2 (what changing
the protocol core alone could buy) and zerolayer ÷ granian.

Part 2, fitness (bench/granian_checks.py): what zerolayer requires of its core, checked on
the wire the same way against granian and the runtime: a decision at HEADERS time without
reading the body, HTTP/2 flood limits (rapid reset, SETTINGS/PING/CONTINUATION/empty DATA
floods) and h2spec. The decision is written up in docs/server-core.md.

    python bench/granian_core.py [-n 20000] [--skip-checks]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import benchlib
import serving_floor
from serving_floor import H1, H2


def granian_cmd(port: int, http: str, app: str = "floor_apps:rsgi_app", workers: int = 1) -> list[str]:
    binary = shutil.which("granian")
    base = [binary] if binary else [sys.executable, "-m", "granian"]
    return [*base, "--interface", "rsgi", "--http", http, "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(workers), "--loop", "uvloop", "--no-log", "--no-ws", "--working-dir",
            str(benchlib.HERE), app]


def speed(n: int) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    plan = [
        ("bare-h2 h2c", lambda p: (serving_floor.bare_cmd(p), None), H2),
        ("granian h2c", lambda p: (granian_cmd(p, "2"), None), H2),
        ("zerolayer h2c", None, H2),
        ("uvicorn h1", lambda p: (serving_floor.uvicorn_cmd(p), None), H1),
        ("granian h1", lambda p: (granian_cmd(p, "1"), None), H1),
        ("zerolayer h1", None, H1),
    ]
    for name, make, shape in plan:
        port = benchlib.free_port()
        if make is None:
            cmd, env, config = serving_floor.runtime_server(port)
            try:
                rows[name] = serving_floor.measure(cmd, port, n, shape, env)
            finally:
                os.unlink(config)
        else:
            cmd, env = make(port)
            rows[name] = serving_floor.measure(cmd, port, n, shape, env)
        print(name, f"{rows[name]['rps']:.0f} req/s", file=sys.stderr, flush=True)
    return rows


def report(rows: dict[str, dict], n: int, checks: str | None) -> str:
    rev = os.environ.get("ZEROLAYER_BENCH_REV", "working tree")
    import granian

    lines = [
        f"server core: granian {granian.__version__} (RSGI, 1 worker, 1 runtime thread) vs python-hyper h2 "
        f"(bare_h2) vs the zerolayer runtime; non-streaming POST {benchlib.CHAT_PATH}; h2load -n {n} "
        f"(h2c: -c {H2['clients']} -m {H2['streams']}; HTTP/1.1: --h1 -c {H1['clients']} -m 1); runtime at {rev}",
        benchlib.machine_line(),
        "",
        f"{'server':<10} {'proto':<5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>10} {'non-2xx':>7}",
    ]
    for name, r in rows.items():
        server, proto = name.split()
        lines.append(f"{server:<10} {proto:<5} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                     f"{r['cpu_ms_per_req']:10.3f} {r['failed']:7d}")
    g2, b2, z2 = rows["granian h2c"], rows["bare-h2 h2c"], rows["zerolayer h2c"]
    g1, u1, z1 = rows["granian h1"], rows["uvicorn h1"], rows["zerolayer h1"]
    lines += [
        "",
        f"h2c: granian / bare-h2 req/s {benchlib.ratio(g2['rps'], b2['rps'])}, CPU/req "
        f"{benchlib.ratio(g2['cpu_ms_per_req'], b2['cpu_ms_per_req'])}; zerolayer / granian req/s "
        f"{benchlib.ratio(z2['rps'], g2['rps'])}",
        f"h1:  granian / uvicorn req/s {benchlib.ratio(g1['rps'], u1['rps'])}, CPU/req "
        f"{benchlib.ratio(g1['cpu_ms_per_req'], u1['cpu_ms_per_req'])}; zerolayer / granian req/s "
        f"{benchlib.ratio(z1['rps'], g1['rps'])}",
    ]
    if checks:
        lines += ["", checks]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000)
    parser.add_argument("--skip-checks", action="store_true", help="only the speed table")
    parser.add_argument("--name", default="granian_core")
    args = parser.parse_args()
    rows = speed(args.n)
    checks = None
    if not args.skip_checks:
        import granian_checks

        checks = granian_checks.run_all()
    text = report(rows, args.n, checks)
    print(text)
    benchlib.save(args.name, text, {"rows": rows, "checks": checks, "command": benchlib.bench_argv(),
                                    "runtime_rev": os.environ.get("ZEROLAYER_BENCH_REV", "working tree")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
