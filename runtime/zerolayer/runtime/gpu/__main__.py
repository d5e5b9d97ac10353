"""Print GPU readings: ``python -m zerolayer.runtime.gpu [--source nvml] [--samples 5]``.

The quick check on a new node that NVML works and what the scheduler would see (the
fullest GPU's memory fraction). ``--source simulated --scenario FILE`` plays a scenario;
``--source cpu`` reads this process (KV-cache use 0: no engine here).
"""

from __future__ import annotations

import argparse
import sys
import time

from .api import GpuSourceError
from .sampler import DEFAULT_INTERVAL_S


def _source(args: argparse.Namespace):
    if args.source == "nvml":
        from .nvml import NvmlSource

        return NvmlSource()
    if args.source == "cpu":
        from .cpu import CpuSource

        return CpuSource(lambda: 0.0)
    from .simulated import SimulatedGpuSource

    if args.scenario:
        return SimulatedGpuSource.from_yaml(args.scenario)
    return SimulatedGpuSource({"name": "demo", "gpus": [{"steps": [{"memory": [0.5, 0.97], "samples": 10}]}]})


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerolayer.runtime.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("nvml", "cpu", "simulated"), default="nvml")
    parser.add_argument("--scenario", help="YAML scenario for --source simulated")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    args = parser.parse_args(argv)
    try:
        source = _source(args)
    except GpuSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{'t_s':>6} {'idx':>3} {'uuid':<40} {'name':<24} {'mem':>6} {'util':>5} {'power_W':>8} {'temp_C':>6} "
          f"{'procs':>5} {'nvlink_err':>10}")
    start = time.monotonic()
    try:
        for i in range(args.samples):
            if i:
                time.sleep(args.interval)
            for r in source.sample():
                print(f"{time.monotonic() - start:6.2f} {r.index:>3} {r.uuid:<40.40} {r.name:<24.24} "
                      f"{r.memory_fraction:6.1%} {r.utilization:5.0%} {_fmt(r.power_watts, '{:8.1f}'):>8} "
                      f"{_fmt(r.temperature_c, '{:6.0f}'):>6} {len(r.processes):>5} {_fmt(r.nvlink_errors, '{:10d}'):>10}")
    except GpuSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
