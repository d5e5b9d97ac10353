"""The runtime against the floor: what serving one chat completion costs with no work behind it.

h2load (nghttp2's C load generator) with the same settings drives, one after the other:

  bare-h2     bench/bare_h2.py: python-hyper h2 on uvloop answering a fixed chat completion
              (the floor for the runtime's own protocol stack: same library, same loop);
  zerolayer   ``zerolayer runtime`` with the synthetic engine (16 tokens, no pacing), auth by
              API key, a tenant with request/token quotas and the scheduler's two-stage
              admission on — over h2c;
  bare-h11    bench/bare_h11.py: python-hyper h11 on uvloop answering the same fixed chat completion
              (the python-hyper floor over HTTP/1.1: the library the runtime's Python core uses);
  uvicorn     a trivial Starlette app on uvicorn (httptools, uvloop) answering the same JSON
              (bench/floor_apps.py): the usual Python HTTP/1.1 stack doing nothing;
  zerolayer   the same runtime over HTTP/1.1;
  zl-noquota  the runtime over h2c with the same tenant but no rate/concurrency quotas (auth and
              admission still on): the difference to the zerolayer h2c row is what quotas cost.

HTTP/2 rows: ``-c 8 -m 16`` (8 connections, 16 streams each: 128 in flight). HTTP/1.1 rows:
``--h1 -c 128 -m 1`` (128 keep-alive connections, no pipelining, which no real client uses):
the same 128 requests in flight. Each row gets a warm-up run first. Server CPU per request
is the server process tree's user+system time over the measured run ÷ answered requests.
``--profile`` then samples the runtime with py-spy during one more h2c run and prints where
its CPU goes (self time by function and by component).

``--api-processes N`` (N > 1) adds two h2c rows: the runtime with ``server.api_processes: N`` (N
interpreters behind one port, the parent handing each connection to the one with the fewest) and
bare-h2 with ``--workers N`` (N processes on one port, SO_REUSEPORT). The multi-process runtime row is
then set against the better of the two bare-h2 rows: the floor is the most the do-nothing server
gives on this machine, with one process or N.

    python bench/serving_floor.py [-n 20000] [--profile] [--api-processes 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import benchlib

H2 = {"clients": 8, "streams": 16}
H1 = {"clients": 128, "streams": 1, "http1": True}


def bare_cmd(port: int, workers: int = 1) -> list[str]:
    return [sys.executable, str(benchlib.HERE / "bare_h2.py"), "--port", str(port), "--workers", str(workers)]


def bare_h11_cmd(port: int) -> list[str]:
    return [sys.executable, str(benchlib.HERE / "bare_h11.py"), "--port", str(port)]


def uvicorn_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(benchlib.HERE), "--port", str(port),
            "--log-level", "warning", "--no-access-log", "--loop", "uvloop", "--http", "httptools",
            "floor_apps:starlette_app"]


def measure(cmd: list[str], port: int, n: int, shape: dict, env: dict | None = None) -> dict:
    """Start the server, warm it up, then one measured h2load run."""
    with benchlib.server(cmd, port, env=env) as proc:
        url = f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}"
        benchlib.h2load(url, n=max(1000, n // 10), **shape)
        return benchlib.h2load(url, n=n, pid=proc.pid, **shape)


def runtime_server(port: int, *extra: str, quotas: bool = True,
                   api_processes: int = 1) -> tuple[list[str], dict[str, str], str]:
    settings = {"server": {"api_processes": api_processes}} if api_processes > 1 else {}
    config = benchlib.write_config(benchlib.runtime_config(port, quotas=quotas, **settings))
    return benchlib.runtime_cmd(config, *extra), {"BENCH_KEY": benchlib.KEY}, config


def profile(n: int) -> dict:
    """py-spy samples of the runtime under one h2c run: self time by function and by component."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy not found (pip install py-spy)")
    port = benchlib.free_port()
    cmd, env, config = runtime_server(port)
    try:
        with benchlib.server(cmd, port, env=env) as proc, tempfile.TemporaryDirectory() as tmp:
            url = f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}"
            benchlib.h2load(url, n=2000, **H2)
            raw = pathlib.Path(tmp, "profile.txt")
            sampler = subprocess.Popen([spy, "record", "-p", str(proc.pid), "--format", "raw", "-o", str(raw),
                                        "-r", "200", "--nonblocking"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            try:
                run = benchlib.h2load(url, n=n, **H2)
            finally:
                sampler.send_signal(2)  # SIGINT: py-spy writes what it has and exits
                sampler.wait(60)
            stacks = raw.read_text().splitlines()
    finally:
        os.unlink(config)
    by_function: collections.Counter[str] = collections.Counter()
    by_component: collections.Counter[str] = collections.Counter()
    total = 0
    for line in stacks:
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        leaf = stack.split(";")[-1]
        total += count
        by_function[leaf] += count
        by_component[component(stack.split(";"))] += count
    return {"samples": total, "rps_while_sampled": run["rps"],
            "by_function": by_function.most_common(15), "by_component": by_component.most_common()}


# Which part of the stack a sample's innermost recognisable frame belongs to.
COMPONENTS = (
    ("h2 library (sans-IO HTTP/2)", ("(h2/", "(hpack/", "(hyperframe/")),
    ("runtime protocol core", ("runtime/protocol/",)),
    ("runtime transport", ("runtime/serving/transport", "runtime/serving/channel", "runtime/serving/handoff")),
    ("runtime scheduler", ("runtime/scheduler/",)),
    ("runtime app/gate/session", ("runtime/serving/app", "runtime/serving/gate", "runtime/serving/session",
                                  "runtime/serving/headers", "runtime/tenants", "runtime/limits")),
    ("runtime wire APIs (JSON)", ("runtime/api/",)),
    ("engine (synthetic)", ("runtime/engine/",)),
    ("metrics", ("runtime/serving/metrics", "prometheus_client")),
    ("metering probe", ("bpf/",)),
    ("json", ("(json/", "orjson")),
    ("asyncio / uvloop", ("(asyncio/", "uvloop")),
)


def component(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needles in COMPONENTS:
            if any(n in frame for n in needles):
                return name
    return "other"


def floor_of(name: str, rows: dict[str, dict]) -> dict:
    """The row ``name`` is set against: bare-h11 for HTTP/1.1; bare-h2 for h2c; for the runtime with N API
    processes (``zerolayer-xN h2c``) the better (more req/s) of bare-h2 with one process and with N."""
    server, proto = name.split()
    if proto != "h2c":
        return rows["bare-h11 h1"]
    if server.startswith("zerolayer-x"):
        many = rows.get(f"bare-h2-x{server.rpartition('-x')[2]} h2c")
        return max([rows["bare-h2 h2c"], *([many] if many else [])], key=lambda r: r["rps"])
    return rows["bare-h2 h2c"]


def report(rows: dict[str, dict], args: argparse.Namespace, prof: dict | None) -> str:
    floor, h1floor, uvicorn = rows["bare-h2 h2c"], rows["bare-h11 h1"], rows["uvicorn h1"]
    rev = os.environ.get("ZEROLAYER_BENCH_REV", "working tree")
    lines = [
        f"serving floor: non-streaming POST {benchlib.CHAT_PATH}, 16-token answer; h2load -n {args.n} "
        f"(h2c: -c {H2['clients']} -m {H2['streams']}; HTTP/1.1: --h1 -c {H1['clients']} -m 1); runtime at {rev}",
        benchlib.machine_line(),
        "",
        f"{'server':<16} {'proto':<5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>10} {'non-2xx':>7}"
        f"  {'req/s vs floor':>14}  {'CPU/req vs floor':>16}",
    ]
    for name, r in rows.items():
        base = floor_of(name, rows)
        lines.append(f"{name.split()[0]:<16} {name.split()[1]:<5} {r['rps']:8.0f} {r['p50_ms']:8.2f} "
                     f"{r['p99_ms']:8.2f} {r['cpu_ms_per_req']:10.3f} {r['failed']:7d}  "
                     f"{benchlib.ratio(r['rps'], base['rps']):>14}  "
                     f"{benchlib.ratio(r['cpu_ms_per_req'], base['cpu_ms_per_req']):>16}")
    z2, z1 = rows["zerolayer h2c"], rows["zerolayer h1"]
    lines += [
        "",
        "floor for h2c rows: bare-h2; for HTTP/1.1 rows: bare-h11 (python-hyper's HTTP/1.1 library).",
        f"zerolayer h2c keeps {z2['rps'] / floor['rps']:.0%} of the bare-h2 floor's req/s (goal >= 80%) at "
        f"{z2['cpu_ms_per_req']:.3f} ms server CPU per request (goal <= 0.2 ms; floor {floor['cpu_ms_per_req']:.3f}).",
        f"zerolayer HTTP/1.1 keeps {z1['rps'] / h1floor['rps']:.0%} of the bare-h11 floor's req/s (goal >= 80%) at "
        f"{z1['cpu_ms_per_req']:.3f} ms server CPU per request (goal <= 0.2 ms; floor {h1floor['cpu_ms_per_req']:.3f});",
        f"  {z1['rps'] / uvicorn['rps']:.0%} of uvicorn's req/s (uvicorn {uvicorn['cpu_ms_per_req']:.3f} ms) and "
        f"{z1['rps'] / floor['rps']:.0%} of the bare-h2 h2c row's.",
        *[f"{name.split()[0]} h2c keeps {r['rps'] / floor_of(name, rows)['rps']:.0%} of the better bare-h2 row's "
          f"req/s ({floor_of(name, rows)['rps']:.0f}) at {r['cpu_ms_per_req']:.3f} ms server CPU per request, "
          f"{r['rps'] / z2['rps']:.2f}x the one-process runtime's req/s."
          for name, r in rows.items() if name.startswith("zerolayer-x")],
        "",
        "commands (URL, headers and body as in bench/serving_floor.py):",
        *sorted({f"  {r['command'].split(' -d ')[0]} ..." for r in rows.values()}),
    ]
    if prof:
        lines += ["", f"where the runtime's CPU goes (py-spy, {prof['samples']} samples at 200 Hz during one more "
                      f"h2c run; {prof['rps_while_sampled']:.0f} req/s while sampled), self time by component:"]
        total = prof["samples"] or 1
        for name, count in prof["by_component"]:
            lines.append(f"  {count / total:6.1%}  {name}")
        lines.append("top functions by self time:")
        for name, count in prof["by_function"]:
            lines.append(f"  {count / total:6.1%}  {name}")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: pathlib.Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
    names = list(rows)
    colors = ["tab:gray" if n.startswith(("bare", "uvicorn")) else "tab:green" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [rows[n]["rps"] for n in names], color=colors)
    ax1.set_ylabel("requests/s (h2load)")
    ax2.bar(names, [rows[n]["cpu_ms_per_req"] for n in names], color=colors)
    ax2.axhline(0.2, color="tab:red", linestyle="--", label="goal: 0.2 ms")
    ax2.set_ylabel("server CPU ms per request")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("zerolayer runtime (synthetic engine) vs do-nothing servers, 2 shared cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="requests per measured run")
    parser.add_argument("--profile", action="store_true", help="also sample the runtime with py-spy")
    parser.add_argument("--name", default="serving_floor", help="results file stem")
    parser.add_argument("--api-processes", type=int, default=1,
                        help="N > 1: also bare-h2 with N workers and the runtime with N API processes (h2c)")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    port = benchlib.free_port()
    rows["bare-h2 h2c"] = measure(bare_cmd(port), port, args.n, H2)
    print("bare-h2 h2c", rows["bare-h2 h2c"]["rps"], file=sys.stderr, flush=True)
    for proto, shape in (("h2c", H2), ("h1", H1)):
        port = benchlib.free_port()
        cmd, env, config = runtime_server(port)
        try:
            rows[f"zerolayer {proto}"] = measure(cmd, port, args.n, shape, env)
        finally:
            os.unlink(config)
        print(f"zerolayer {proto}", rows[f"zerolayer {proto}"]["rps"], file=sys.stderr, flush=True)
        if proto == "h2c":
            port = benchlib.free_port()
            cmd, env, config = runtime_server(port, quotas=False)
            try:
                rows["zl-noquota h2c"] = measure(cmd, port, args.n, shape, env)
            finally:
                os.unlink(config)
            print("zl-noquota h2c", rows["zl-noquota h2c"]["rps"], file=sys.stderr, flush=True)
            port = benchlib.free_port()
            rows["uvicorn h1"] = measure(uvicorn_cmd(port), port, args.n, H1)
            print("uvicorn h1", rows["uvicorn h1"]["rps"], file=sys.stderr, flush=True)
            port = benchlib.free_port()
            rows["bare-h11 h1"] = measure(bare_h11_cmd(port), port, args.n, H1)
            print("bare-h11 h1", rows["bare-h11 h1"]["rps"], file=sys.stderr, flush=True)
    order = ["bare-h2 h2c", "zerolayer h2c", "zl-noquota h2c", "uvicorn h1", "bare-h11 h1", "zerolayer h1"]
    if args.api_processes > 1:
        n = args.api_processes
        port = benchlib.free_port()
        rows[f"bare-h2-x{n} h2c"] = measure(bare_cmd(port, workers=n), port, args.n, H2)
        port = benchlib.free_port()
        cmd, env, config = runtime_server(port, api_processes=n)
        try:
            rows[f"zerolayer-x{n} h2c"] = measure(cmd, port, args.n, H2, env)
        finally:
            os.unlink(config)
        order += [f"bare-h2-x{n} h2c", f"zerolayer-x{n} h2c"]
    # Table order: each floor above the runtime row it is the floor for.
    rows = {k: rows[k] for k in order}
    prof = profile(args.n) if args.profile else None
    text = report(rows, args, prof)
    print(text)
    data = {"rows": rows, "profile": prof, "runtime_rev": os.environ.get("ZEROLAYER_BENCH_REV", "working tree"),
            "command": benchlib.bench_argv()}
    benchlib.save(args.name, text, data)
    plot(rows, benchlib.RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
