"""What a request and a streamed token cost the runtime, against the floors and granian, in one run (issue 29).

Three shapes, each driven by h2load with the same settings against every server, one after the other:

  h2c      non-streaming POST /v1/chat/completions, 16-token answer; ``-c 8 -m 16`` (128 in flight)
  h1       the same over HTTP/1.1; ``--h1 -c 128 -m 1``
  stream   ``"stream": true``, 64 tokens per response (64 SSE chunk events, then ``[DONE]``); h2c
           ``-c 64 -m 1`` (64 streams in flight) and HTTP/1.1 ``--h1 -c 64``

Servers (the do-nothing ones answer bench/bare_h2.py's fixed JSON or its ``stream_events``):

  bare-h2      python-hyper h2 on uvloop, no work: the floor of the runtime's own protocol stack
  bare-h11     python-hyper's h11 on uvloop, no work (bench/bare_h11.py): the HTTP/1.1 floor
  uvicorn      Starlette on uvicorn (httptools, uvloop), no work: the usual Python HTTP/1.1 server
  granian      granian's RSGI on hyper (Rust), no work: what a compiled core costs by itself
  zerolayer    ``zerolayer runtime``, synthetic engine (no pacing), API-key auth, a tenant with quotas,
               two-stage admission; ``server.core: python`` (the sans-IO core on python-hyper h2)
  zl-native    the same runtime with ``server.core: native``, when native/h2core is installed: the
               compiled cores, Rust h2 for HTTP/2 and llhttp (httptools, protocol/h1native.py) for
               HTTP/1.1; a row for every shape

Server CPU per request is the server process's user+system time over the measured run ÷ answered
requests; per streamed token, that ÷ 64. ``--reps N`` runs every row N times, rows interleaved, and
reports medians. Ratios: req/s and CPU against the shape's floor (bare-h2 over h2c, bare-h11 over
HTTP/1.1, streaming or not) and against granian.

    python bench/serving_cost.py [-n 20000] [--stream-n 4000] [--reps 2] [--shapes h2c,h1,stream] [--save]
                                 [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable

import benchlib
import serving_floor
from granian_core import granian_cmd

STREAM_TOKENS = 64
STREAM_BODY = json.dumps({"model": "synthetic", "max_tokens": STREAM_TOKENS, "stream": True,
                          "messages": [{"role": "user", "content": "what does a zero layer cost?"}]}).encode()
SHAPES: dict[str, dict[str, Any]] = {
    "h2c": {"clients": 8, "streams": 16},
    "h1": {"clients": 128, "streams": 1, "http1": True},
    "stream h2c": {"clients": 64, "streams": 1, "body": STREAM_BODY},
    "stream h1": {"clients": 64, "streams": 1, "http1": True, "body": STREAM_BODY},
}


def native_available() -> bool:
    try:
        import zerolayer_h2core  # noqa: F401  (the compiled core's extension module)
    except ImportError:
        return False
    return True


def runtime(core: str, tokens: int) -> Callable[[int], tuple[list[str], dict[str, str], str]]:
    def make(port: int) -> tuple[list[str], dict[str, str], str]:
        engine = {"kind": "synthetic", "models": ["synthetic"], "output_tokens": tokens}
        extra = {"server": {"core": core}}  # named: the default is native where it is installed
        config = benchlib.write_config(benchlib.runtime_config(port, engine, **extra))
        return benchlib.runtime_cmd(config), {"BENCH_KEY": benchlib.KEY}, config
    return make


def plain(cmd: Callable[[int], list[str]], env: dict[str, str] | None = None) -> Callable[[int], tuple]:
    return lambda port: (cmd(port), env or {}, None)


def plan(shapes: list[str], native: bool) -> list[tuple[str, str, Callable[[int], tuple]]]:
    """(row name, shape, server factory) in table order: each floor above the rows it is the floor for."""
    rows: list[tuple[str, str, Callable[[int], tuple]]] = []
    stream_env = {"BENCH_STREAM_TOKENS": str(STREAM_TOKENS)}
    if "h2c" in shapes:
        rows += [("bare-h2", "h2c", plain(serving_floor.bare_cmd)),
                 ("granian", "h2c", plain(lambda p: granian_cmd(p, "2"))),
                 ("zerolayer", "h2c", runtime("python", 16))]
        if native:
            rows.append(("zl-native", "h2c", runtime("native", 16)))
    if "h1" in shapes:
        rows += [("bare-h11", "h1", plain(serving_floor.bare_h11_cmd)),
                 ("uvicorn", "h1", plain(serving_floor.uvicorn_cmd)),
                 ("granian", "h1", plain(lambda p: granian_cmd(p, "1"))),
                 ("zerolayer", "h1", runtime("python", 16))]
        if native:
            rows.append(("zl-native", "h1", runtime("native", 16)))
    if "stream" in shapes:
        rows += [("bare-h2", "stream h2c", plain(lambda p: [*serving_floor.bare_cmd(p), "--stream-tokens",
                                                            str(STREAM_TOKENS)])),
                 ("granian", "stream h2c", plain(lambda p: granian_cmd(p, "2", "floor_apps:rsgi_stream_app"),
                                                 stream_env)),
                 ("zerolayer", "stream h2c", runtime("python", STREAM_TOKENS))]
        if native:
            rows.append(("zl-native", "stream h2c", runtime("native", STREAM_TOKENS)))
        rows += [("bare-h11", "stream h1", plain(lambda p: [*serving_floor.bare_h11_cmd(p), "--stream-tokens",
                                                              str(STREAM_TOKENS)])),
                 ("granian", "stream h1", plain(lambda p: granian_cmd(p, "1", "floor_apps:rsgi_stream_app"),
                                                stream_env)),
                 ("zerolayer", "stream h1", runtime("python", STREAM_TOKENS))]
        if native:
            rows.append(("zl-native", "stream h1", runtime("native", STREAM_TOKENS)))
    return rows


def measure(make: Callable[[int], tuple], shape: str, n: int) -> dict[str, Any]:
    port = benchlib.free_port()
    cmd, env, config = make(port)
    try:
        with benchlib.server(cmd, port, env=env) as proc:
            url = f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}"
            settings = SHAPES[shape]
            benchlib.h2load(url, n=max(500, n // 10), **settings)
            return benchlib.h2load(url, n=n, pid=proc.pid, **settings)
    finally:
        if config:
            os.unlink(config)


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for key in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req"):
        row[key] = statistics.median(r[key] for r in runs)
    row["failed"] = sum(r["failed"] for r in runs)
    row["reps"] = [{k: r[k] for k in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req", "failed")} for r in runs]
    return row


def floor_of(shape: str) -> str:
    return {"h2c": "bare-h2", "h1": "bare-h11", "stream h2c": "bare-h2", "stream h1": "bare-h11"}[shape]


def report(rows: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace) -> str:
    rev = os.environ.get("ZEROLAYER_BENCH_REV", "working tree")
    lines = [
        f"serving cost: POST {benchlib.CHAT_PATH}; h2c/h1: 16-token JSON answer, h2load -n {args.n}; stream: "
        f"{STREAM_TOKENS} SSE tokens per response, h2load -n {args.stream_n}; median of {args.reps} rep(s), rows "
        f"interleaved; runtime at {rev}",
        benchlib.machine_line(),
        "",
        f"{'server':<10} {'shape':<10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>10} "
        f"{'CPU us/tok':>10} {'fail':>5}  {'req/s vs floor':>14} {'CPU vs floor':>12} {'req/s vs granian':>16}",
    ]
    for (server, shape), r in rows.items():
        floor = rows.get((floor_of(shape), shape))
        granian = rows.get(("granian", shape))
        per_token = f"{r['cpu_ms_per_req'] * 1000 / STREAM_TOKENS:10.1f}" if shape.startswith("stream") else \
            f"{'':>10}"
        lines.append(
            f"{server:<10} {shape:<10} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
            f"{r['cpu_ms_per_req']:10.3f} {per_token} {r['failed']:5d}  "
            f"{benchlib.ratio(r['rps'], floor['rps']) if floor else 'n/a':>14} "
            f"{benchlib.ratio(r['cpu_ms_per_req'], floor['cpu_ms_per_req']) if floor else 'n/a':>12} "
            f"{benchlib.ratio(r['rps'], granian['rps']) if granian else 'n/a':>16}")
    lines += ["", "floors: bare-h2 for h2c and stream h2c, bare-h11 for h1 and stream h1. Goals (issue 29): "
                  ">= 0.8x the floor's req/s, <= 0.2 ms CPU per request."]
    h2floor = rows.get(("bare-h2", "h2c"))  # the floor issue 29 names: a do-nothing python-hyper h2 server
    for server in ("zerolayer", "zl-native"):
        for shape in ("h2c", "h1", "stream h2c", "stream h1"):
            r, floor = rows.get((server, shape)), rows.get((floor_of(shape), shape))
            if r and floor:
                lines.append(f"  {server} {shape}: {r['rps'] / floor['rps']:.2f}x the floor's req/s at "
                             f"{r['cpu_ms_per_req']:.3f} ms CPU per request (floor {floor['cpu_ms_per_req']:.3f})")
            if r and shape == "h1" and h2floor:
                lines.append(f"  {server} h1: {r['rps'] / h2floor['rps']:.2f}x bare-h2's h2c req/s")
    lines += ["", "commands (URL, headers and body as in bench/serving_cost.py):",
              *sorted({f"  {r['command'].split(' -d ')[0]} ..." for r in rows.values()})]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="requests per measured non-streaming run")
    parser.add_argument("--stream-n", type=int, default=4000, help="requests per measured streaming run")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--shapes", default="h2c,h1,stream")
    parser.add_argument("--no-native", action="store_true", help="leave out the compiled core's rows")
    parser.add_argument("--save", action="store_true", help="write bench/results/NAME.{txt,json}")
    parser.add_argument("--name", default="serving_cost", help="the result files' name (with --save)")
    args = parser.parse_args()
    native = native_available() and not args.no_native
    if not native and not args.no_native:
        print("zl-native rows left out: the compiled core is not installed (pip install ./native/h2core)",
              file=sys.stderr)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    todo = plan(args.shapes.split(","), native)
    for rep in range(args.reps):
        for server, shape, make in todo:
            n = args.stream_n if shape.startswith("stream") else args.n
            result = measure(make, shape, n)
            runs.setdefault((server, shape), []).append(result)
            print(f"rep {rep + 1} {server} {shape}: {result['rps']:.0f} req/s, "
                  f"{result['cpu_ms_per_req']:.3f} ms CPU/req", file=sys.stderr, flush=True)
    rows = {key: median_row(r) for key, r in runs.items()}
    text = report(rows, args)
    print(text)
    if args.save:
        benchlib.save(args.name, text, {"rows": {f"{s} {h}": r for (s, h), r in rows.items()},
                                             "command": benchlib.bench_argv()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
