"""``zerolayer auditor`` (the daemon) and ``zerolayer audit`` (reports and checks on the store)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``1h``, ``7d``, ``2w`` → seconds."""
    m = DURATION.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number and a unit s, m, h, d or w (e.g. 1h)")
    return float(m.group(1)) * UNITS[m.group(2)]


def _process_filter_options(p: argparse.ArgumentParser) -> None:
    """Which runtimes' tokens the auditor meters (the kernel path's filters) and where their probe is."""
    p.add_argument("--pid", type=int, action="append", default=[], help="meter only this runtime process (repeat)")
    p.add_argument("--cgroup", action="append", default=[],
                   help="meter only processes in this cgroup v2 directory or below it (repeat)")
    p.add_argument("--pod", action="append", default=[], metavar="NAMESPACE/NAME",
                   help="meter only this pod's processes on this node (its cgroup; repeat; needs get on pods)")
    p.add_argument("--pod-uid", action="append", default=[], metavar="UID",
                   help="the same by pod UID, no API call (a sidecar: the downward API's metadata.uid)")
    p.add_argument("--cgroup-root", default="/sys/fs/cgroup",
                   help="where the host's cgroup tree is visible, for --pod/--pod-uid (default /sys/fs/cgroup)")
    p.add_argument("--probe-library", metavar="PATH",
                   help="the runtimes' zerolayer/bpf/_probes*.so as seen from here, if not this installation's "
                        "(another image: /proc/<pid>/root/...)")
    p.add_argument("--pids-from-spool", action="store_true",
                   help="meter only runtimes that announce themselves in --spool (their pids, found as they start)")


def _cluster_options(p: argparse.ArgumentParser) -> None:
    """TenantQuota usage, energy and the pod's Event: what the auditor does in a cluster."""
    p.add_argument("--tenant-quotas", action="store_true",
                   help="read prices from TenantQuotas (every status cycle) and publish status.usage (Kubernetes)")
    p.add_argument("--kubeconfig",
                   help="kubeconfig for --tenant-quotas and --pod (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--status-interval", type=float, default=15.0,
                   help="at most one TenantQuota status write per tenant per this many seconds")
    p.add_argument("--energy-price-per-kwh", default="0", help="electricity rate with --tenant-quotas")
    p.add_argument("--gpu-source", default="none",
                   help="GPU power for energy cost: none, nvml, auto (nvml where a driver answers, else none), "
                        "or simulated:SCENARIO.yaml (a simulation)")
    p.add_argument("--mode-event-pod", metavar="NAMESPACE/NAME",
                   help="record the mode the auditor meters in (kernel or journal, and why) as an Event on this "
                        "pod, shown by kubectl describe (the operator passes the auditor's own pod)")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "auditor", help="meter every token: BPF (or in-process journal) events into the audit store",
        description="Attach to the runtimes' USDT probe (or tail their journals), aggregate per tenant, model and "
                    "minute into the audit store, reconcile with the runtimes' counters, publish TenantQuota usage.")
    p.add_argument("--db", default="audit.db", help="SQLite audit store (default audit.db)")
    p.add_argument("--clickhouse", metavar="URL",
                   help="mirror the audit tables to ClickHouse for the fleet (http://[user:pw@]host:8123/db)")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or os.uname().nodename,
                   help="this node's name in ClickHouse rows and its key under TenantQuota status.usage.nodes "
                        "(default: $NODE_NAME, else the host name)")
    p.add_argument("--source", choices=("auto", "bpf", "journal"), default="auto",
                   help="bpf: the kernel path; journal: the in-process path; auto: bpf if it can run here")
    p.add_argument("--spool", help="the runtimes' --audit-spool directory (counters snapshots, journals)")
    _process_filter_options(p)
    p.add_argument("--ring-buffer-mb", type=float, default=16.0,
                   help="BPF ring buffer size: the node's peak events/s x the 0.1 s drain (an event is ~110 bytes)")
    p.add_argument("--flush-interval", type=float, default=0.5, help="seconds between store writes")
    p.add_argument("--reconcile-interval", type=float, default=5.0, help="seconds between counter cross-checks")
    _reconcile_limit_options(p)
    p.add_argument("--retention", type=parse_duration, default=parse_duration("7d"),
                   help="keep per-event detail this long (default 7d); aggregates are kept")
    p.add_argument("--aggregate-retention", type=parse_duration, default=None, help="drop aggregates older than this")
    p.add_argument("--prices", help="price file (see docs/audit.md) for the cost in TenantQuota usage")
    _cluster_options(p)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--print-bpf", action="store_true", help="print the BPF program that would be loaded and exit")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run_auditor)

    a = subparsers.add_parser("audit", help="reports and checks on the audit store",
                              description="Usage, cost and consistency from the audit store.")
    sub = a.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    r = sub.add_parser("report", help="usage and cost per tenant and model")
    r.add_argument("--db", default="audit.db")
    r.add_argument("--clickhouse", metavar="URL", help="report the whole fleet from ClickHouse instead of --db")
    r.add_argument("--tenant", help="only this tenant")
    r.add_argument("--since", type=parse_duration, default=parse_duration("1h"), help="window length (default 1h)")
    r.add_argument("--output", choices=("table", "json", "csv"), default="table")
    r.add_argument("--prices", help="price file (default: token counts only, zero prices)")
    r.add_argument("--tenant-quotas", action="store_true", help="prices from the cluster's TenantQuotas")
    r.add_argument("--kubeconfig")
    r.add_argument("--energy-price-per-kwh", default="0")
    r.set_defaults(handler=run_report)
    s = sub.add_parser("status", help="mode, lost and missing events, reconciliations, disagreements")
    s.add_argument("--db", default="audit.db")
    s.add_argument("--output", choices=("table", "json"), default="table")
    s.set_defaults(handler=run_status)
    c = sub.add_parser("reconcile", help="reconcile from counters snapshots now (with the auditor stopped)")
    c.add_argument("--db", default="audit.db")
    c.add_argument("--spool", required=True)
    _reconcile_limit_options(c)
    c.set_defaults(handler=run_reconcile)


def _reconcile_limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reconcile-max-ratio", type=float, default=1.0,
                        help="tokens booked from a runtime's counters stay within this share of the tokens metered "
                             "from its events (per tenant and model; default 1.0); the rest is held, not billed")
    parser.add_argument("--reconcile-min-tokens", type=int, default=100_000,
                        help="...but may always reach this many tokens (default 100000)")


def _limits(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from zerolayer.bpf.store import ReconcileLimits

    return ReconcileLimits(max_ratio=args.reconcile_max_ratio, min_tokens=args.reconcile_min_tokens)


def _price_book(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from zerolayer.bpf.billing import PriceBook, load_price_book, price_book_from_quotas

    if args.prices:
        return load_price_book(args.prices)
    if args.tenant_quotas:
        from zerolayer.bpf.kube import TenantQuotaApi

        return price_book_from_quotas(TenantQuotaApi(args.kubeconfig).list(), args.energy_price_per_kwh)
    return PriceBook({})


def _energy_source(spec: str):  # type: ignore[no-untyped-def]
    from zerolayer.bpf.errors import AuditError

    if spec == "none":
        return None
    if spec in ("auto", "nvml"):
        from zerolayer.runtime.gpu.api import GpuSourceError
        from zerolayer.runtime.gpu.nvml import NvmlSource

        try:
            return NvmlSource(None)
        except GpuSourceError as exc:
            if spec == "nvml":  # asked for by name: a clear exit (2), not a traceback
                raise AuditError(f"--gpu-source=nvml: {exc}") from exc
            # auto, what the operator deploys: a node without a driver bills without the energy part
            logging.getLogger(__name__).warning(
                "--gpu-source=auto: NVML did not start (%s): usage is billed without its energy part", exc)
            return None
    if spec.startswith("simulated:"):
        from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

        return SimulatedGpuSource.from_yaml(spec.split(":", 1)[1])
    raise AuditError(f"--gpu-source: none, nvml, auto or simulated:FILE, got {spec!r}")


def _pod_cgroups(pods: list[str], uids: list[str], kubeconfig: str | None, cgroup_root: str) -> list[str]:
    """``--pod NAMESPACE/NAME`` and ``--pod-uid UID`` -> the pods' cgroup directories on this host (an error if
    a pod has none here)."""
    from zerolayer.bpf.errors import AuditError, BpfUnavailable
    from zerolayer.bpf.loader import cgroup2_root, pod_cgroups

    wanted = [(uid, f"uid {uid}") for uid in uids]
    if pods:
        from zerolayer.bpf.kube import pod_uid

        wanted += [(pod_uid(ref, kubeconfig), ref) for ref in pods]
    found: list[str] = []
    for uid, name in wanted:
        try:
            dirs = pod_cgroups(uid, cgroup2_root(cgroup_root))
        except BpfUnavailable as exc:  # no cgroup v2 there
            raise BpfUnavailable(f"cannot find the cgroup of pod {name}: {exc}") from exc
        if not dirs:
            raise AuditError(f"pod {name} (uid {uid}) has no cgroup on this host: is it running on this node?")
        logging.getLogger(__name__).info("pod %s: cgroup %s", name, ", ".join(dirs))
        found += dirs
    return found


@dataclasses.dataclass
class _Opened:
    """The event source the auditor meters from, and why it is not the kernel's when ``auto`` fell back."""

    source: Any
    fallback: str | None = None


def _open_event_source(args: argparse.Namespace, store: Any) -> _Opened:
    """``--source`` opened: the pod filters first (the kernel path's), then the source itself."""
    from zerolayer.bpf.auditor import open_source
    from zerolayer.bpf.errors import BpfUnavailable

    kind, cgroups, fallback = args.source, list(args.cgroup), None
    if kind != "journal":  # the pod filters are the kernel path's
        try:
            cgroups += _pod_cgroups(args.pod, args.pod_uid, args.kubeconfig, args.cgroup_root)
        except BpfUnavailable as exc:
            if kind == "bpf":
                raise
            logging.getLogger(__name__).warning("%s: using the in-process journal path", exc)
            kind, fallback = "journal", str(exc)
    reasons: list[str] = []
    source = open_source(kind, spool=args.spool, store=store, ring_buffer_bytes=int(args.ring_buffer_mb * (1 << 20)),
                         pids=args.pid, cgroups=cgroups, pids_from_spool=args.pids_from_spool,
                         library=args.probe_library, on_fallback=reasons.append)
    return _Opened(source, fallback or (reasons[0] if reasons else None))


def mode_message(kind: str, requested: str, fallback: str | None) -> str:
    """``<kind> mode: why``, naming the mode the auditor meters in: its pod's Event and its log line."""
    if kind == "bpf":
        return "bpf mode: in the kernel, attached to the runtime's USDT token probe"
    if fallback:
        return f"journal mode: the kernel path could not start here ({fallback}); metering from the runtime's journal"
    return f"journal mode: --source={requested}; metering from the runtime's journal"


def _announce_mode(args: argparse.Namespace, opened: _Opened) -> None:
    """Log the mode and, with ``--mode-event-pod``, record it as an Event on the pod (``kubectl describe``).
    An Event that cannot be written is logged: metering goes on, and the log still names the mode."""
    from zerolayer.bpf.errors import AuditError

    message = mode_message(opened.source.kind, args.source, opened.fallback)
    kind, _, why = message.partition(" mode: ")
    print(f"zerolayer auditor: {kind} mode, store {args.db} ({why})", flush=True)
    if not args.mode_event_pod:
        return
    from zerolayer.bpf import kube

    def record() -> None:
        kube.record_pod_event(args.mode_event_pod, uid=args.pod_uid[0] if args.pod_uid else None,
                              reason="AuditorKernelMode" if opened.source.kind == "bpf" else "AuditorJournalMode",
                              message=message, warning=opened.fallback is not None, kubeconfig=args.kubeconfig)
    try:
        record()
    except AuditError as exc:
        logging.getLogger(__name__).warning("%s; trying again in the background", exc)
        threading.Thread(target=record_with_retries, args=(record, MODE_EVENT_RETRY_DELAYS_S),
                         name="mode-event", daemon=True).start()


# A mode Event refused at start (the API server away, the pod's RBAC not there yet) is tried again
# after these waits, in the background; metering never waits for it.
MODE_EVENT_RETRY_DELAYS_S = (2.0, 4.0, 8.0, 16.0, 30.0)


def record_with_retries(record: Callable[[], None], delays: Sequence[float],
                        sleep: Callable[[float], None] = time.sleep) -> bool:
    """Call ``record`` after each of ``delays`` until it succeeds; False (and logged) when none did."""
    from zerolayer.bpf.errors import AuditError

    last: Exception | None = None
    for delay in delays:
        sleep(delay)
        try:
            record()
            return True
        except AuditError as exc:
            last = exc
    logging.getLogger(__name__).warning("%s; gave up after %d more tries", last, len(delays))
    return False


def _build_auditor(args: argparse.Namespace, store: Any, source: Any) -> Any:
    from zerolayer.bpf.auditor import Auditor, AuditorSettings

    writer = None
    if args.tenant_quotas:
        from zerolayer.bpf.kube import QuotaStatusWriter, TenantQuotaApi

        quota_api = TenantQuotaApi(args.kubeconfig)
        writer = QuotaStatusWriter(quota_api, node=args.node_name, min_interval_s=args.status_interval,
                                   watch=quota_api.watch())
    mirror = None
    if args.clickhouse:
        from zerolayer.bpf.clickhouse import ClickHouseMirror, connect

        mirror = ClickHouseMirror(connect(args.clickhouse), args.node_name)
    settings = AuditorSettings(flush_interval_s=args.flush_interval, reconcile_interval_s=args.reconcile_interval,
                               detail_retention_s=args.retention, aggregate_retention_s=args.aggregate_retention,
                               status_interval_s=args.status_interval)
    return Auditor(store, source, spool=args.spool, settings=settings, energy_source=_energy_source(
        args.gpu_source), quota_writer=writer, pids_from_spool=args.pids_from_spool, mirror=mirror,
        # with --tenant-quotas and no --prices: the TenantQuotas' prices, re-read every status cycle
        prices=None if args.tenant_quotas and not args.prices else _price_book(args),
        energy_per_kwh=args.energy_price_per_kwh)


def run_auditor(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from zerolayer.bpf.errors import AuditError

    if args.print_bpf:
        from zerolayer.bpf.loader import render_program

        print(render_program(ring_buffer_bytes=int(args.ring_buffer_mb * (1 << 20)), filter_pids=bool(args.pid),
                             filter_cgroups=bool(args.cgroup or args.pod or args.pod_uid)))
        return 0
    from zerolayer.bpf.store import SqliteStore

    try:
        store = SqliteStore(args.db, limits=_limits(args))
        opened = _open_event_source(args, store)
        auditor = _build_auditor(args, store, opened.source)
    except AuditError as exc:
        print(f"zerolayer auditor: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=auditor.metrics.registry)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: auditor.stop())
    _announce_mode(args, opened)
    try:
        auditor.run()
    except AuditError as exc:
        print(f"zerolayer auditor: {exc}", file=sys.stderr)
        return 1
    return 0


def run_report(args: argparse.Namespace) -> int:
    from zerolayer.bpf.billing import bill
    from zerolayer.bpf.errors import AuditError
    from zerolayer.bpf.store import NS, SqliteStore

    try:
        book = _price_book(args)
        store: SqliteStore | ClickHouseMirror
        if args.clickhouse:
            from zerolayer.bpf.clickhouse import ClickHouseMirror, connect

            store = ClickHouseMirror(connect(args.clickhouse), "")
        else:
            store = SqliteStore(args.db)
        bills = bill(store.usage(time.time_ns() - int(args.since * NS), tenant=args.tenant), book)
    except AuditError as exc:
        print(f"zerolayer audit: {exc}", file=sys.stderr)
        return 2
    rows = [b.as_dict() for b in bills]
    if args.output == "json":
        print(json.dumps(rows, indent=2))
    elif args.output == "csv":
        buf = io.StringIO()
        fields = list(rows[0]) if rows else ["tenant", "model", "currency", "input_tokens", "output_tokens",
                                             "requests", "reconciled_tokens", "energy_kwh", "input_cost",
                                             "output_cost", "energy_cost", "total"]
        w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        print(buf.getvalue(), end="")
    else:
        print(table(rows, ["tenant", "model", "requests", "input_tokens", "output_tokens", "reconciled_tokens",
                           "energy_kwh", "total", "currency"]))
    return 0


def table(rows: list[dict[str, Any]], columns: list[str], empty: str = "(no usage in this window)") -> str:
    widths = [max([len(c)] + [len(str(r[c])) for r in rows]) for c in columns]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths))]
    for r in rows:
        lines.append("  ".join(str(r[c]).rjust(w) if isinstance(r[c], int) else str(r[c]).ljust(w)
                               for c, w in zip(columns, widths)))
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    from zerolayer.bpf.errors import AuditError
    from zerolayer.bpf.store import SqliteStore

    try:
        store = SqliteStore(args.db)
        totals = store.totals()
    except AuditError as exc:
        print(f"zerolayer audit: {exc}", file=sys.stderr)
        return 2
    doc = {"mode": store.state("mode", "unknown"), "kernel_lost_events": int(store.state("kernel_lost_total") or 0),
           **totals}
    if args.output == "json":
        print(json.dumps(doc, indent=2))
        return 0
    print(f"mode: {doc['mode']}   kernel lost events: {doc['kernel_lost_events']}")
    print(table(doc["runtimes"], ["runtime_id", "pid", "hwm", "events", "missing", "counters_seq", "final"],
                "(no runtime seen yet)"))
    if doc["reconciliations"]:
        print()
        print(table(doc["reconciliations"], ["runtime_id", "tenant", "model", "counters_seq", "input_tokens",
                                              "output_tokens", "events", "kind"]))
    return 1 if any(r["kind"] in ("disagreement", "held") for r in doc["reconciliations"]) else 0


def run_reconcile(args: argparse.Namespace) -> int:
    import pathlib

    from zerolayer.bpf.errors import AuditError, CountersError
    from zerolayer.bpf.store import SqliteStore

    try:
        store = SqliteStore(args.db, limits=_limits(args))
        found = []
        for path in sorted(pathlib.Path(args.spool).glob("*.counters.json")):
            try:
                found.extend(store.reconcile(json.loads(path.read_text())))
            except (CountersError, ValueError) as exc:  # one bad document does not stop the others
                print(f"zerolayer audit: skipping {path}: {exc}", file=sys.stderr)
    except (AuditError, OSError) as exc:
        print(f"zerolayer audit: {exc}", file=sys.stderr)
        return 2
    for r in found:
        print(f"{r.kind}: runtime {r.runtime_id} {r.tenant}/{r.model}: input {r.input_tokens:+d}, output "
              f"{r.output_tokens:+d}, events {r.events:+d} (counters seq {r.counters_seq})")
    if not found:
        print("store agrees with every runtime's counters")
    return 1 if any(r.kind in ("disagreement", "held") for r in found) else 0
