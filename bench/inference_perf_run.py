"""zerolayer and `vllm serve` side by side under kubernetes-sigs inference-perf, the serving working
group's benchmark, with its own report.

The two stacks of bench/vs_vllm_serve.py (same tiny generated model and engine settings; zerolayer
with auth, quotas, two-stage admission and metering on) started together; inference-perf runs
against each in turn with the same config: OpenAI completions (its random data generator drives only that API), streaming, random prompts of 64
tokens and 32 output tokens (``ignore_eos``), the model's own tokenizer, ``concurrent`` load stages
(``--concurrency``, ``--requests`` each). inference-perf needs Python >= 3.12, so it lives in its own
virtual environment (``--venv``, default ``~/.cache/zerolayer/bench-venvs/inference-perf``; make it
with ``python3.12 -m venv DIR && DIR/bin/pip install inference-perf==0.7.0``). Its summary reports
(``summary_lifecycle_metrics.json`` and per stage) are saved under
``bench/results/inference_perf/<stack>/`` and the table below is read from them.

    python bench/inference_perf_run.py [--concurrency 1 4] [--requests 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import benchlib
from vs_vllm_serve import MODEL_DIR, SERVED, stacks

DEFAULT_VENV = pathlib.Path(os.environ.get("ZEROLAYER_CACHE", pathlib.Path.home() / ".cache" / "zerolayer"),
                            "bench-venvs", "inference-perf")
OUT = benchlib.RESULTS / "inference_perf"


def config(port: int, args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    fixed = {"type": "fixed", "min": 1, "max": 1024}
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random", "input_distribution": {**fixed, "mean": 64},
                 "output_distribution": {**fixed, "mean": 32}},
        "load": {"type": "concurrent", "num_workers": 1,
                 "stages": [{"num_requests": args.requests, "concurrency_level": c} for c in args.concurrency]},
        "server": {"type": "vllm", "model_name": SERVED, "base_url": f"http://127.0.0.1:{port}",
                   "ignore_eos": True, "api_key": benchlib.KEY},
        "tokenizer": {"pretrained_model_name_or_path": str(MODEL_DIR)},
        # server-reported completion_tokens: re-tokenizing random-weight text miscounts
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False,
                                         "use_server_output_tokens": True}},
        "storage": {"local_storage": {"path": str(out)}},
    }


def run(venv: pathlib.Path, port: int, args: argparse.Namespace, out: pathlib.Path, log: pathlib.Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config(port, args, out), f)  # JSON is YAML
    try:
        with open(log, "w") as sink:  # the client in a session that outranks the servers' (benchlib.run_client)
            done, _ = benchlib.run_client([str(venv / "bin" / "inference-perf"), "-c", f.name], log=sink,
                                          timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"inference-perf failed ({done.returncode}):\n{log.read_text()[-3000:]}")
    finally:
        os.unlink(f.name)


def stage_rows(out: pathlib.Path) -> list[dict[str, Any]]:
    """(stage, concurrency) -> the numbers the table shows, from inference-perf's per-stage reports."""
    rows = []
    for path in sorted(out.glob("stage_*_lifecycle_metrics.json")):
        report = json.loads(path.read_text())
        success = report.get("successes", {})
        latency = success.get("latency", {})
        throughput = success.get("throughput", {})
        rows.append({
            "stage": path.name.split("_")[1],
            "requests": success.get("count"),
            "failures": report.get("failures", {}).get("count"),
            "output_tokens_per_s": throughput.get("output_tokens_per_sec"),
            "requests_per_s": throughput.get("requests_per_sec"),
            "ttft_p50_ms": _ms(latency.get("time_to_first_token", {}).get("median")),
            "ttft_p99_ms": _ms(latency.get("time_to_first_token", {}).get("p99")),
            "tpot_p50_ms": _ms(latency.get("time_per_output_token", {}).get("median")),
        })
    return rows


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else float(seconds) * 1000


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"inference-perf 0.7.0, /v1/completions streaming, random 64-token prompts, 32 output tokens (ignore_eos), "
             f"{args.requests} requests per stage at concurrency {', '.join(map(str, args.concurrency))}; "
             f"runtime at {os.environ.get('ZEROLAYER_BENCH_REV', 'working tree')}", benchlib.machine_line(), "",
             f"{'stack':<11} {'conc':>4} {'ok':>4} {'fail':>4} {'out tok/s':>9} {'req/s':>6} {'TTFT p50':>9} "
             f"{'TTFT p99':>9} {'TPOT p50':>9}  {'tok/s vs vllm':>13}"]
    base = {r["stage"]: r for r in results.get("vllm-serve", [])}
    for name, rows in results.items():
        for concurrency, r in zip(args.concurrency, rows):
            ref = base.get(r["stage"], {}).get("output_tokens_per_s")
            lines.append(f"{name:<11} {concurrency:>4} {fmt(r['requests'], 'd'):>4} {fmt(r['failures'], 'd'):>4} "
                         f"{fmt(r['output_tokens_per_s'], '.1f'):>9} {fmt(r['requests_per_s'], '.2f'):>6} "
                         f"{fmt(r['ttft_p50_ms'], '.1f'):>9} {fmt(r['ttft_p99_ms'], '.1f'):>9} "
                         f"{fmt(r['tpot_p50_ms'], '.2f'):>9}  {benchlib.ratio(r['output_tokens_per_s'], ref):>13}")
    lines += ["", "times in ms; inference-perf's own reports: bench/results/inference_perf/<stack>/"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=32, help="requests per stage")
    parser.add_argument("--venv", type=pathlib.Path, default=DEFAULT_VENV)
    parser.add_argument("--logs", type=pathlib.Path, help="keep the servers' and inference-perf's logs here")
    args = parser.parse_args()
    if not (args.venv / "bin" / "inference-perf").exists():
        print(f"no inference-perf in {args.venv} (see this script's docstring)", file=sys.stderr)
        return 2
    results: dict[str, list[dict[str, Any]]] = {}
    logs = args.logs or pathlib.Path(tempfile.mkdtemp(prefix="inference-perf-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs: {logs}", file=sys.stderr, flush=True)
    with stacks(None, logs) as found:
        for name in ("vllm-serve", "zerolayer"):
            out = OUT / name
            shutil.rmtree(out, ignore_errors=True)
            run(args.venv, found[name][0], args, out, logs / f"inference-perf-{name}.log")
            for echo in [out / "config.yaml", *out.glob("inference-perf.partial.*.yaml")]:
                echo.unlink()  # the config echoed back, with this machine's paths: the function above is the config
            results[name] = stage_rows(out)
    text = report(results, args)
    print(text)
    benchlib.save("inference_perf", text, {"results": results, "command": benchlib.bench_argv()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
