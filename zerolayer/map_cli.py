"""``zerolayer map``: a live table of every InferenceNode and its GPUs, from the gossip in their status.

Reads through :mod:`zerolayer.gpumap`, so the verdicts (stale, utilisation, admitting) are the
same ones the runtimes and the SDK act on. ``--once`` prints one table; ``--json`` prints the
map document (the runtime's map endpoint serves the same shape).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from zerolayer.gpumap import FleetMap, GpuMapError, GpuMapWatcher, NodeEntry

CLEAR = "\x1b[H\x1b[2J"


def _gib(value: int) -> str:
    return f"{value / 1024**3:.1f}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _node_rows(node: NodeEntry) -> list[list[str]]:
    state = "yes" if node.admitting else f"NO ({node.reason})"
    age = "-" if node.age_s is None else f"{node.age_s:.1f}s"
    load = "-" if node.running is None else f"{node.running}/{node.waiting} kv {_opt(node.kv_cache_usage, '.0%')}"
    prefix = "-" if node.prefix_blocks is None else f"{node.prefix_blocks} hit {_opt(node.prefix_hit_rate, '.0%')}"
    rows = [[node.name, node.endpoint or "-", state, age, node.gpus_admitting,
             "-" if node.memory_percent is None else f"{node.memory_percent}%", load, "", "", "", "", "", "", prefix]]
    for g in node.gpus:
        rows.append(["", f"  gpu{g.index} {g.name}".rstrip(), "yes" if g.admitting else "NO", "", "",
                     f"{g.memory_fraction:.0%}", "", f"{_gib(g.memory_used_bytes)}/{_gib(g.memory_total_bytes)}",
                     _opt(g.utilization, ".0%"), _opt(g.power_watts, ".0f"), _opt(g.temperature_c, ".0f"),
                     _opt(g.fragmentation, ".0%"), "-" if g.nvlink_errors is None else str(g.nvlink_errors), ""])
    return rows


HEADER = ["NODE", "ENDPOINT / GPU", "ADMITTING", "HEARTBEAT", "GPUS", "MEM", "RUN/WAIT", "GiB", "UTIL", "W",
          "°C", "FRAG", "NVLINK-ERR", "PREFIX-BLOCKS"]


def render_table(fleet: FleetMap) -> str:
    """The map as a fixed-width text table (one line per node, one per GPU under it)."""
    rows = [HEADER]
    for node in fleet.nodes:
        rows.extend(_node_rows(node))
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    admitting = len(fleet.admitting())
    lines.append("")
    lines.append(f"{len(fleet.nodes)} node(s), {admitting} admitting; "
                 f"read {time.strftime('%H:%M:%S', time.localtime(fleet.read_at))}")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "map", help="live table of every InferenceNode's GPU map (from the runtimes' gossip)",
        description="Watch InferenceNode objects and show each node's GPUs, load and whether it admits work.")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    parser.add_argument("--json", action="store_true", help="print the map document as JSON and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        watcher = GpuMapWatcher(kubeconfig=args.kubeconfig).start()
    except GpuMapError as exc:
        print(f"zerolayer map: {exc}", file=sys.stderr)
        return 2
    try:
        if not watcher.wait_ready(10.0):
            print(f"zerolayer map: {watcher.last_error or 'no answer from the API server within 10s'}",
                  file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(watcher.snapshot().to_document(), indent=2))
            return 0
        if args.once:
            print(render_table(watcher.snapshot()))
            return 0
        live = sys.stdout.isatty()
        while True:
            text = render_table(watcher.snapshot())
            if watcher.last_error is not None:
                text += f"\nwatch error (showing last known state): {watcher.last_error}"
            print((CLEAR if live else "") + text, flush=True)
            if not live:
                print()
            time.sleep(args.interval)
    finally:
        watcher.stop()
