"""The auditor daemon: token events from one source into the store, exactly once, cross-checked.

One thread, no event loop: ``poll`` the source (kernel ring buffer or journals) → batch → every
``flush_interval_s`` one store transaction (events, aggregates, high-water marks, resume state).
Every ``reconcile_interval_s`` it reads the runtimes' counters snapshots, drains the source (so
every event a snapshot covers that will ever arrive has arrived), writes, and reconciles: missing
tokens are booked from the counters (``reconciled``), a store above the counters is reported as a
``disagreement`` in the log, the metrics and the ``reconciliations`` table. It also integrates GPU
energy, prunes old detail and publishes TenantQuota usage at a bounded rate.

Mode (``bpf`` or ``journal``) is logged at start, exported as ``zerolayer_auditor_mode`` and kept in
the store's ``auditor_state``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import threading
import time
from decimal import Decimal
from typing import Any, Callable, Protocol, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from zerolayer.bpf.billing import PriceBook, Prices, bill, parse_decimal, prices_from_spec
from zerolayer.bpf.errors import AuditError, BillingError, BpfUnavailable, CountersError
from zerolayer.bpf.events import TokenEvent
from zerolayer.bpf.store import NS, SqliteStore, minute_of, parse_counters

log = logging.getLogger(__name__)


class EventSource(Protocol):
    kind: str

    def poll(self, timeout_ms: int = 100) -> list[TokenEvent]: ...
    def lost(self) -> int: ...
    def close(self) -> None: ...


@dataclasses.dataclass
class AuditorSettings:
    flush_interval_s: float = 0.5
    max_batch: int = 20000
    reconcile_interval_s: float = 5.0
    detail_retention_s: float = 7 * 86400.0
    aggregate_retention_s: float | None = None  # None: keep aggregates forever
    prune_interval_s: float = 300.0
    energy_interval_s: float = 1.0
    status_interval_s: float = 15.0
    mirror_interval_s: float = 10.0


class AuditorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.mode = Gauge("zerolayer_auditor_mode", "1 for the mode the auditor runs in", ["mode"], registry=r)
        self.events = Counter("zerolayer_auditor_events", "Token events written to the store", registry=r)
        self.duplicates = Counter("zerolayer_auditor_duplicate_events", "Replayed events recognised and skipped",
                                  registry=r)
        self.kernel_lost = Gauge("zerolayer_auditor_kernel_lost_events",
                                 "Events lost before the store (all sessions): the kernel ring buffer was full, or "
                                 "(journal path) torn or corrupt journal records skipped", registry=r)
        self.missing = Gauge("zerolayer_auditor_missing_events",
                             "Sequence gaps: events that never reached the store (all runtimes)", registry=r)
        self.reconciled = Counter("zerolayer_auditor_reconciled_tokens",
                                  "Tokens booked from runtime counters for missing events", ["kind"], registry=r)
        self.disagreements = Counter("zerolayer_auditor_disagreements",
                                     "Times the store held more tokens than a runtime counted", registry=r)
        self.held = Counter("zerolayer_auditor_held_tokens",
                            "Tokens runtime counters claimed beyond the reconcile limits: held, not billed",
                            ["kind"], registry=r)
        self.bad_counters = Counter("zerolayer_auditor_bad_counters",
                                    "Malformed runtime counters documents skipped (each file version once)",
                                    registry=r)
        self.flush_seconds = Gauge("zerolayer_auditor_last_flush_seconds", "Duration of the last store write",
                                   registry=r)
        # Audit lag on a dashboard is time() minus this; an auditor that stops writing lets it age.
        self.flushed_at = Gauge("zerolayer_auditor_last_flush_timestamp_seconds",
                                "When the last store write ended (Unix seconds)", registry=r)


class Auditor:
    def __init__(self, store: SqliteStore, source: EventSource, *, spool: str | pathlib.Path | None = None,
                 settings: AuditorSettings | None = None, metrics: AuditorMetrics | None = None,
                 energy_source: Any = None, quota_writer: Any = None, prices: PriceBook | None = None,
                 clock: Callable[[], float] = time.monotonic, pids_from_spool: bool = False,
                 mirror: Any = None, energy_per_kwh: str = "0") -> None:
        """``prices``: a fixed price book; None with a ``quota_writer``: the TenantQuotas' ``spec.prices``, read
        again every status cycle (with ``energy_per_kwh``)."""
        self.store = store
        self.source = source
        self.spool = pathlib.Path(spool) if spool is not None else None
        self.settings = settings or AuditorSettings()
        self.metrics = metrics or AuditorMetrics()
        self.energy_source = energy_source
        self.quota_writer = quota_writer
        self.mirror = mirror  # ClickHouseMirror or None
        self.prices = prices
        self._prices_from_quotas = prices is None and quota_writer is not None
        self._energy_per_kwh = parse_decimal(energy_per_kwh, "energy price") if self._prices_from_quotas else None
        self.clock = clock
        self.stopping = threading.Event()
        self.pids_from_spool = pids_from_spool and hasattr(source, "add_pid") and self.spool is not None
        self._known_pids: set[int] = set()
        self._known_files: set[str] = set()
        if self.pids_from_spool:
            self.discover_runtimes()
        self._buffer: list[TokenEvent] = []
        self._committed_state: dict[str, str] | None = None
        self._lost_base = int(store.state("kernel_lost_total", "0") or 0)
        self._snapshot_seen: dict[str, tuple[int, bool]] = {}
        self._bad_counters: dict[str, tuple[int, int]] = {}  # file name -> (mtime_ns, size) seen malformed
        self._last_energy: float | None = None
        self.metrics.mode.labels(source.kind).set(1)
        store.set_state({"mode": source.kind})
        log.info("auditor running in %s mode (store %s)", source.kind, getattr(store, "path", store.kind))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        s = self.settings
        now = self.clock()
        next_flush = now + s.flush_interval_s
        next_reconcile = now + s.reconcile_interval_s
        next_prune = now
        next_energy = now
        next_status = now + s.status_interval_s
        next_mirror = now + s.mirror_interval_s
        try:
            while not self.stopping.is_set():
                self._buffer.extend(self.source.poll(100))
                now = self.clock()
                if now >= next_flush or len(self._buffer) >= s.max_batch:
                    if self.pids_from_spool:
                        self.discover_runtimes()
                    self.flush()
                    next_flush = now + s.flush_interval_s
                if now >= next_reconcile:
                    self.reconcile()
                    next_reconcile = now + s.reconcile_interval_s
                if self.energy_source is not None and now >= next_energy:
                    self.sample_energy()
                    next_energy = now + s.energy_interval_s
                if now >= next_prune:
                    self.prune()
                    next_prune = now + s.prune_interval_s
                if self.quota_writer is not None and now >= next_status:
                    self.publish_status()
                    next_status = now + s.status_interval_s
                if self.mirror is not None and now >= next_mirror:
                    self.sync_mirror()
                    next_mirror = now + s.mirror_interval_s
        finally:
            # Each shutdown step on its own: one that fails (a damaged source, a locked store) must neither hide
            # the error that ended the loop nor skip the others.
            for step in (self.drain, self.reconcile, self.sync_mirror if self.mirror is not None else None):
                if step is None:
                    continue
                try:
                    step()
                except Exception:
                    log.exception("auditor shutdown: %s failed", step.__name__)
            self.source.close()

    def stop(self) -> None:
        self.stopping.set()

    # ------------------------------------------------------------------ steps
    def flush(self) -> None:
        batch, self._buffer = self._buffer, []
        state: dict[str, str] = getattr(self.source, "state", lambda: {})()
        lost = self.source.lost()
        state["kernel_lost_total"] = str(self._lost_base + lost)
        if not batch and state == self._committed_state:
            return  # nothing new: no transaction, no fsync (an idle auditor stays idle)
        self._committed_state = dict(state)
        started = time.perf_counter()
        result = self.store.write(batch, state)
        getattr(self.source, "committed", lambda: None)()
        self.metrics.flush_seconds.set(time.perf_counter() - started)
        self.metrics.flushed_at.set_to_current_time()
        self.metrics.events.inc(result.written)
        self.metrics.duplicates.inc(result.duplicates)
        self.metrics.kernel_lost.set(self._lost_base + lost)

    def discover_runtimes(self) -> None:
        """Meter every runtime that announced itself in the spool (its probe writes counters at start)."""
        assert self.spool is not None
        for path in self.spool.glob("*.counters.json"):
            if path.name in self._known_files:
                continue  # one file per runtime process: read it once
            try:
                pid = parse_counters(json.loads(path.read_text()))["pid"]
            except (OSError, ValueError, CountersError):
                continue  # being replaced right now (or malformed, which reconcile reports): next round
            self._known_files.add(path.name)
            if pid not in self._known_pids:
                self._known_pids.add(pid)
                self.source.add_pid(pid)  # type: ignore[attr-defined]
                log.info("metering runtime pid %d (%s)", pid, path.name.split(".")[0])

    def drain(self) -> None:
        """Poll until the source is empty, then write: everything submitted so far is in the store."""
        while True:
            batch = self.source.poll(0)
            if not batch:
                break
            self._buffer.extend(batch)
        self.flush()

    def reconcile(self) -> list[Any]:
        """Cross-check every runtime's counters snapshot against the store (see the module docstring)."""
        if self.spool is None or not self.spool.is_dir():
            return []
        snapshots = []
        for path in sorted(self.spool.glob("*.counters.json")):
            doc = self._read_counters(path)
            if doc is None:
                continue
            seen = self._snapshot_seen.get(doc["runtime_id"])
            if seen == (doc["seq"], doc["final"]):
                continue
            snapshots.append(doc)
        if not snapshots:
            return []
        self.drain()  # after reading the snapshots: covers every event they count
        found = []
        for doc in snapshots:
            for r in self.store.reconcile(doc):
                found.append(r)
                if r.kind == "held":
                    self.metrics.held.labels("input").inc(max(0, r.input_tokens))
                    self.metrics.held.labels("output").inc(max(0, r.output_tokens))
                    log.error("runtime %s counters claim %d input, %d output tokens in %d events for %s/%s beyond "
                              "what may be booked from counters (seq gaps, reconcile limits): held, not billed",
                              r.runtime_id, r.input_tokens, r.output_tokens, r.events, r.tenant, r.model)
                elif r.kind == "disagreement":
                    self.metrics.disagreements.inc()
                    log.error("runtime %s counted fewer tokens than the store holds for %s/%s (input %+d, output "
                              "%+d, events %+d as of seq %d)", r.runtime_id, r.tenant, r.model, r.input_tokens,
                              r.output_tokens, r.events, r.counters_seq)
                else:
                    self.metrics.reconciled.labels("input").inc(r.input_tokens)
                    self.metrics.reconciled.labels("output").inc(r.output_tokens)
                    log.warning("reconciled %d events (%d input, %d output tokens) for %s/%s from runtime %s "
                                "counters", r.events, r.input_tokens, r.output_tokens, r.tenant, r.model, r.runtime_id)
            self._snapshot_seen[doc["runtime_id"]] = (doc["seq"], doc["final"])
        self.metrics.missing.set(sum(r["missing"] for r in self.store.totals()["runtimes"]))
        return found

    def _read_counters(self, path: pathlib.Path) -> dict[str, Any] | None:
        """The validated document, or None (unreadable now, or malformed: logged and counted once per version)."""
        try:
            stat = path.stat()
            text = path.read_text()
        except OSError as exc:
            log.warning("skipping unreadable counters %s: %s", path, exc)
            return None
        try:
            return parse_counters(json.loads(text))
        except (ValueError, CountersError) as exc:
            version = (stat.st_mtime_ns, stat.st_size)
            if self._bad_counters.get(path.name) != version:
                self._bad_counters[path.name] = version
                self.metrics.bad_counters.inc()
                log.error("skipping malformed counters %s: %s", path, exc)
            return None

    def sync_mirror(self) -> None:
        from zerolayer.bpf.errors import StoreError

        try:
            self.mirror.sync(self.store)
        except StoreError as exc:  # the local store is the ledger: the next sync re-sends what failed
            log.warning("ClickHouse mirror not updated: %s", exc)

    def sample_energy(self) -> None:
        now = self.clock()
        try:
            readings = self.energy_source.sample()
        except Exception as exc:  # a GpuSourceError or a driver hiccup: skip one sample, keep metering
            log.warning("GPU power sample failed: %s", exc)
            return
        if self._last_energy is not None:
            dt = now - self._last_energy
            minute = minute_of(time.time_ns())
            for g in readings:
                if g.power_watts is not None:
                    self.store.add_energy(minute, g.uuid, g.power_watts * dt)
        self._last_energy = now

    def prune(self) -> None:
        now = time.time_ns()
        s = self.settings
        aggregates = None if s.aggregate_retention_s is None else now - int(s.aggregate_retention_s * NS)
        dropped = self.store.prune(now - int(s.detail_retention_s * NS), aggregates)
        if dropped:
            log.info("pruned %d token events older than the retention", dropped)
        if self.spool is not None and self.source.kind != "journal" and self.spool.is_dir():
            from zerolayer.bpf.journal import discard_unread_journals

            removed = discard_unread_journals(self.spool)  # the runtime may journal (audit.mode auto); unread here
            if removed:
                log.info("deleted %d journal segments the kernel path does not read", removed)

    def publish_status(self) -> None:
        """This node's usage into every TenantQuota's status (see bpf/kube.py): re-reads the TenantQuotas
        (tenants created since, prices changed since) and the running totals; never rescans the history."""
        from zerolayer.bpf.errors import QuotaStatusError
        from zerolayer.bpf.kube import usage_fields

        window = minute_of(time.time_ns())
        try:
            quotas = self.quota_writer.refresh()
            if self._prices_from_quotas:
                self.prices = self._quota_prices(quotas)
            current = self.store.usage(window * NS)
            totals = self.store.usage_totals()
            book = self.prices or PriceBook({})
            costs: dict[str, Decimal] = {}
            for b in bill(totals, book):
                costs[b.tenant] = costs.get(b.tenant, Decimal(0)) + b.total
            usage: dict[str, dict[str, Any]] = {}
            for r in totals:
                u = usage.setdefault(r.tenant, {"in": 0, "out": 0, "win": 0, "req": 0})
                u["in"] += r.input_tokens + r.reconciled_input
                u["out"] += r.output_tokens + r.reconciled_output
            for r in current:
                u = usage.setdefault(r.tenant, {"in": 0, "out": 0, "win": 0, "req": 0})
                u["win"] += r.input_tokens + r.output_tokens + r.reconciled_input + r.reconciled_output
                u["req"] += r.requests
            self.quota_writer.publish({t: usage_fields(window, u["win"], u["req"], u["in"], u["out"],
                                                       str(costs.get(t, Decimal(0))))
                                       for t, u in usage.items()})
        except QuotaStatusError as exc:
            log.warning("TenantQuota status not updated: %s", exc)

    def _quota_prices(self, quotas: Sequence[Any]) -> PriceBook:
        """Prices from the TenantQuotas; an invalid one keeps that tenant's previous prices (and says so)."""
        previous = self.prices.tenants if self.prices is not None else {}
        tenants: dict[str, Prices] = {}
        for q in quotas:
            spec = q.get("spec") or {}
            tenant = spec.get("tenant")
            if not tenant:
                continue
            try:
                tenants[str(tenant)] = prices_from_spec(spec.get("prices") or {}, f"TenantQuota "
                                                        f"{(q.get('metadata') or {}).get('name')}.spec.prices")
            except BillingError as exc:
                log.warning("%s: keeping the previous prices", exc)
                if str(tenant) in previous:
                    tenants[str(tenant)] = previous[str(tenant)]
        return PriceBook(tenants, self._energy_per_kwh or Decimal(0))


def open_source(kind: str, *, spool: str | None, store: SqliteStore, ring_buffer_bytes: int,
                pids: Sequence[int] = (), cgroups: Sequence[str] = (), pids_from_spool: bool = False,
                library: str | None = None, on_fallback: Callable[[str], None] | None = None) -> EventSource:
    """``kind`` is ``bpf``, ``journal`` or ``auto`` (the kernel path if it can run here, else journals).
    ``on_fallback(reason)`` is called when ``auto`` could not attach in the kernel and journals instead."""
    if kind in ("bpf", "auto"):
        from zerolayer.bpf.loader import BpfTokenSource

        try:
            return BpfTokenSource(ring_buffer_bytes=ring_buffer_bytes, pids=pids, cgroups=cgroups,
                                  filter_pids=pids_from_spool, library=library)
        except BpfUnavailable as exc:
            if kind == "bpf":
                raise
            log.warning("BPF unavailable (%s): using the in-process journal path", exc)
            if on_fallback is not None:
                on_fallback(str(exc))
    if spool is None:
        raise AuditError("the journal path needs --spool (the runtime's --audit-spool directory)")
    from zerolayer.bpf.journal import JournalSource

    resume = dict(store.db.execute("SELECT key, value FROM auditor_state WHERE key LIKE 'journal:%'").fetchall())
    return JournalSource(spool, resume)
