"""``zerolayer defragd``: the gpu-defragd container's command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Callable, Mapping

NVML_RETRY_FIRST_S = 5.0
NVML_RETRY_MAX_S = 60.0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "defragd", help="nudge idle GPU processes of this pod (SIGUSR1); reset fragmented GPUs when allowed",
        description="gpu-defragd: scan GPU compute processes every intervalSeconds (InferenceNode spec.defrag).")
    parser.add_argument("--node-name", help="InferenceNode to read spec.defrag from and record Events on "
                                            "(without it: defaults, Events only in the log)")
    parser.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, then ~/.kube/config)")
    parser.add_argument("--source", choices=("nvml", "simulated"), default="nvml", help="GPU source (default nvml)")
    parser.add_argument("--scenario", help="scenario YAML for --source simulated")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--pod-root", type=int, help="our pod is this PID and its descendants")
    scope.add_argument("--pod-pids", help="our pod is exactly these PIDs (comma-separated)")
    parser.add_argument("--interval", type=float, help="seconds between scans (overrides spec.defrag.intervalSeconds)")
    parser.add_argument("--idle-minutes", type=float, help="overrides spec.defrag.idleMinutes")
    parser.add_argument("--dry-run", action="store_true", default=None, help="report, never signal or reset")
    parser.add_argument("--once", action="store_true", help="one scan, print what was done, exit")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(handler=run)


def wait_for_gpu_source(open_source: Callable[[], Any], stopped: threading.Event, *, wait: bool,
                        first_s: float = NVML_RETRY_FIRST_S, max_s: float = NVML_RETRY_MAX_S) -> Any:
    """``open_source()``; while it raises ``GpuSourceError`` and ``wait`` is set, try again (the delay
    doubles from ``first_s`` to ``max_s``) until it opens or ``stopped`` is set (then None).

    Why wait rather than exit: defragd is a sidecar of the runtime pod, and a sidecar that exits
    crash-loops, which makes the whole pod not Ready and takes the node's server out of service
    because of an optimisation. A GPU driver that is not loaded yet (a driver DaemonSet still
    installing) or not there at all is logged at every try and otherwise waited out. Without
    ``wait`` (``--once``) the error is raised as before.
    """
    from zerolayer.runtime.gpu.api import GpuSourceError

    delay = first_s
    while True:
        try:
            return open_source()
        except GpuSourceError as exc:
            if not wait:
                raise
            logging.getLogger(__name__).warning("defragd: %s; trying again in %.0fs (idle until then)", exc, delay)
        if stopped.wait(delay):
            return None
        delay = min(max_s, delay * 2)


def pod_scope(args: argparse.Namespace) -> Any:
    """Whose GPU processes are ours: ``--pod-root``'s process tree, ``--pod-pids``, else our cgroup."""
    from .scope import PidAllowlist, PodCgroup, ProcessTree

    if args.pod_root:
        return ProcessTree(args.pod_root)
    if args.pod_pids:
        return PidAllowlist(int(p) for p in args.pod_pids.split(",") if p.strip())
    return PodCgroup()


def gpu_source(args: argparse.Namespace) -> Any:
    """The simulated source of ``--scenario``, or NVML once the driver answers (None: SIGTERM came first)."""
    from .errors import DefragError

    if args.source == "simulated":
        from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

        if not args.scenario:
            raise DefragError("--source simulated needs --scenario FILE")
        return SimulatedGpuSource.from_yaml(args.scenario)
    from zerolayer.runtime.gpu.nvml import NvmlSource

    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        return wait_for_gpu_source(NvmlSource, stopped, wait=not args.once)
    finally:
        signal.signal(signal.SIGTERM, previous)


def describe_scan(report: Any) -> str:
    """What ``--once`` prints of one scan."""
    return (f"nudged {[n.pid for n in report.nudged]}, would nudge {[n.pid for n in report.would_nudge]}, "
            f"foreign {list(report.foreign)}, resets {[(r.gpu_index, r.action) for r in report.resets]}, "
            f"fragmentation {dict(report.fragmentation)}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from zerolayer.runtime.gossip.errors import KubeApiError
    from zerolayer.runtime.gpu.api import GpuSourceError

    from .daemon import DefragMetrics, Defragd, KubeEvents, LogEvents
    from .errors import DefragError

    try:
        scope = pod_scope(args)
        source = gpu_source(args)
    except (DefragError, GpuSourceError, ValueError) as exc:
        print(f"zerolayer defragd: {exc}", file=sys.stderr)
        return 2
    if source is None:  # SIGTERM while waiting for the driver
        return 0

    api = None
    last: dict[str, Mapping[str, Any] | None] = {"node": None}
    if args.node_name:
        from zerolayer.runtime.gossip.kube import NodeApi

        try:
            api = NodeApi(kubeconfig=args.kubeconfig, component="zerolayer-defragd")
        except KubeApiError as exc:
            print(f"zerolayer defragd: {exc}", file=sys.stderr)
            return 2

    def node() -> Mapping[str, Any] | None:
        if api is None:
            return None
        try:
            last["node"] = api.get(args.node_name)
        except KubeApiError as exc:  # keep the last known policy; Events wait for the API server
            logging.getLogger(__name__).warning("defragd: %s", exc)
        return last["node"]

    overrides = {"dry_run": args.dry_run, "interval_s": args.interval,
                 "idle_s": args.idle_minutes * 60 if args.idle_minutes is not None else None}
    metrics = DefragMetrics()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=metrics.registry)
    events = KubeEvents(api, lambda: last["node"]) if api is not None else LogEvents()
    daemon = Defragd(source, scope, node=node, policy_overrides=overrides, events=events, metrics=metrics)
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    print(f"zerolayer defragd: {source.kind} source, scope {scope.describe()}", flush=True)
    try:
        if args.once:
            report = daemon.scan_once()
            print(describe_scan(report))
            return 0 if report.error is None else 1
        daemon.run()
        return 0
    finally:
        source.close()
        if api is not None:
            api.close()
