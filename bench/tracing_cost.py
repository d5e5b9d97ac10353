"""What OpenTelemetry tracing costs the runtime per request: the serving-floor run with tracing off and on.

The same ``zerolayer runtime`` (synthetic engine, 16 tokens, auth and quotas on, as in
bench/serving_floor.py) twice under h2load over h2c (``-c 8 -m 16``): once with no
``telemetry.tracing`` (the default: sessions keep no timeline), once with
``telemetry.tracing.otlp_endpoint`` pointing at an OTLP/HTTP receiver in this process
(tests/otlp_receiver.py; it decodes every batch, so the exporter's work is real). Every request
is traced (six spans: the request, gate, admission, queue or not, prefill, decode). Each row gets a
warm-up run first; server CPU per request is the runtime's user+system time over the measured
run ÷ answered requests. Read the ratios: 2 shared cores.

    python bench/tracing_cost.py [-n 8000]
"""

from __future__ import annotations

import argparse
import os
import sys

import benchlib

sys.path.insert(0, str(benchlib.HERE.parent))
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

H2 = {"clients": 8, "streams": 16}


def measure(n: int, tracing: dict | None) -> dict:
    port = benchlib.free_port()
    extra = {"telemetry": {"tracing": tracing}} if tracing else {}
    config = benchlib.write_config(benchlib.runtime_config(port, **extra))
    try:
        with benchlib.server(benchlib.runtime_cmd(config), port, env={"BENCH_KEY": benchlib.KEY}) as proc:
            url = f"http://127.0.0.1:{port}{benchlib.CHAT_PATH}"
            benchlib.h2load(url, n=max(1000, n // 10), **H2)
            return benchlib.h2load(url, n=n, pid=proc.pid, **H2)
    finally:
        os.unlink(config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=8000, help="requests per measured run")
    args = parser.parse_args()
    with OtlpReceiver() as receiver:
        rows = {"tracing off": measure(args.n, None),
                "tracing on": measure(args.n, {"otlp_endpoint": receiver.endpoint})}
        spans = len(receiver.spans)
    off, on = rows["tracing off"], rows["tracing on"]
    lines = [f"tracing cost: non-streaming POST {benchlib.CHAT_PATH}, 16-token answer, h2load -n {args.n} "
             f"-c {H2['clients']} -m {H2['streams']} (h2c), runtime at "
             f"{os.environ.get('ZEROLAYER_BENCH_REV', 'working tree')}", benchlib.machine_line(), "",
             f"{'runtime':<12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>10} {'non-2xx':>7}"
             f"  {'req/s vs off':>12}  {'CPU/req vs off':>14}"]
    for name, r in rows.items():
        lines.append(f"{name:<12} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['cpu_ms_per_req']:10.3f} "
                     f"{r['failed']:7d}  {benchlib.ratio(r['rps'], off['rps']):>12}  "
                     f"{benchlib.ratio(r['cpu_ms_per_req'], off['cpu_ms_per_req']):>14}")
    lines += ["", f"spans the receiver decoded during the traced runs (warm-up included): {spans}",
              f"tracing adds {on['cpu_ms_per_req'] - off['cpu_ms_per_req']:.3f} ms of runtime CPU per request "
              "(span building and OTLP export in the SDK's thread)."]
    text = "\n".join(lines)
    print(text)
    benchlib.save("tracing_cost", text, {"rows": rows, "spans": spans, "command": benchlib.bench_argv()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
