"""The audit store: token events in, per tenant/model/minute usage out, each event counted once.

Schema (the same tables in SQLite and ClickHouse, see :mod:`zerolayer.bpf.clickhouse`):

``token_events``   detail, one row per event, key ``(runtime_id, seq)``; pruned after the retention.
``usage_minute``   aggregates per (minute, tenant, model): tokens from events plus ``reconciled_*``
                   tokens booked from the runtime's counters for events that never arrived, and the
                   row's ``energy_share`` as last folded into ``usage_total``.
``usage_total``    running totals per (tenant, model) since the store began (the same figures as
                   summing ``usage_minute``, with the energy share): status reads them, never rescans.
``minute_changes`` per minute, the store's change counter when its usage or energy last changed:
                   consumers (the totals' energy share, the ClickHouse mirror) keep a cursor into it.
``runtimes``       per runtime instance: high-water mark ``hwm`` (highest seq written), events
                   written, ``pruned_seq`` (detail below it was pruned), last counters seq reconciled.
``runtime_ledger`` per (runtime, tenant, model): cumulative booked and reconciled tokens -- what the
                   runtime's own counters are compared with.
``reconciliations`` one row per adjustment, held claim or disagreement found.
``energy_minute``  GPU energy per (minute, gpu) in joules, integrated from power readings.
``auditor_state``  key/value: journal offsets, kernel lost-event totals, mode.

Exactly once: :meth:`SqliteStore.write` inserts the detail rows with ``ON CONFLICT DO NOTHING`` and adds
only the rows that were new to the aggregates, the ledger, the high-water mark and the source's
resume state (journal offsets) -- all in one transaction. A crash before COMMIT writes nothing; a
replay after it is recognised by the key (or, once pruned, by ``pruned_seq``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sqlite3
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

from zerolayer.bpf.counters import ReconcileLimits, Reconciliation, parse_counters, reconcile_counters
from zerolayer.bpf.errors import StoreError
from zerolayer.bpf.events import NS, TokenEvent, minute_of
from zerolayer.bpf.ingest import apply_fold, fold_events

# Re-exported: what the auditor, the CLI and tests import from the store.
__all__ = ["NS", "MIGRATIONS", "SCHEMA", "ReconcileLimits", "Reconciliation", "SqliteStore", "UsageRow",
           "WriteResult", "aggregate_usage", "minute_of", "parse_counters", "transaction"]

# The counters a usage row carries, the same in the per-minute rows and the running totals.
_USAGE_COUNTS = """input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0, events INTEGER NOT NULL DEFAULT 0,
    reconciled_input INTEGER NOT NULL DEFAULT 0, reconciled_output INTEGER NOT NULL DEFAULT 0,"""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS token_events (
    runtime_id TEXT NOT NULL, seq INTEGER NOT NULL, wall_ns INTEGER NOT NULL,
    tenant TEXT NOT NULL, model TEXT NOT NULL, request_id TEXT NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, flags INTEGER NOT NULL,
    pid INTEGER NOT NULL, cgroup_id INTEGER NOT NULL, source TEXT NOT NULL,
    PRIMARY KEY (runtime_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS token_events_time ON token_events (wall_ns);
CREATE TABLE IF NOT EXISTS usage_minute (
    minute INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    {_USAGE_COUNTS}
    energy_share REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, tenant, model)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_minute_tenant ON usage_minute (tenant, minute);
CREATE TABLE IF NOT EXISTS usage_total (
    tenant TEXT NOT NULL, model TEXT NOT NULL,
    {_USAGE_COUNTS}
    energy_joules REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, model)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS minute_changes (minute INTEGER PRIMARY KEY, change INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS minute_changes_change ON minute_changes (change);
CREATE TABLE IF NOT EXISTS runtimes (
    runtime_id TEXT PRIMARY KEY, pid INTEGER NOT NULL DEFAULT 0, hwm INTEGER NOT NULL DEFAULT 0,
    events INTEGER NOT NULL DEFAULT 0, pruned_seq INTEGER NOT NULL DEFAULT 0,
    first_ns INTEGER NOT NULL DEFAULT 0, last_ns INTEGER NOT NULL DEFAULT 0,
    counters_seq INTEGER NOT NULL DEFAULT 0, final INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS runtime_ledger (
    runtime_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    events INTEGER NOT NULL DEFAULT 0, requests INTEGER NOT NULL DEFAULT 0,
    reconciled_input INTEGER NOT NULL DEFAULT 0, reconciled_output INTEGER NOT NULL DEFAULT 0,
    reconciled_events INTEGER NOT NULL DEFAULT 0,
    held_input INTEGER NOT NULL DEFAULT 0, held_output INTEGER NOT NULL DEFAULT 0,
    held_events INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (runtime_id, tenant, model)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reconciliations (
    at_ns INTEGER NOT NULL, runtime_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    counters_seq INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    events INTEGER NOT NULL, kind TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS energy_minute (
    minute INTEGER NOT NULL, gpu TEXT NOT NULL, joules REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, gpu)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS auditor_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class WriteResult:
    written: int  # new events, counted now
    duplicates: int  # already in the store (replays), not counted again


# Columns added after the first release: (table, column, definition) for stores created before them.
MIGRATIONS = (
    ("usage_minute", "energy_share", "REAL NOT NULL DEFAULT 0"),
    ("runtime_ledger", "held_input", "INTEGER NOT NULL DEFAULT 0"),
    ("runtime_ledger", "held_output", "INTEGER NOT NULL DEFAULT 0"),
    ("runtime_ledger", "held_events", "INTEGER NOT NULL DEFAULT 0"),
)


@dataclasses.dataclass(frozen=True)
class UsageRow:
    tenant: str
    model: str
    input_tokens: int
    output_tokens: int
    requests: int
    events: int
    reconciled_input: int
    reconciled_output: int
    energy_joules: float = 0.0


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` .. ``COMMIT``, rolled back on any exception (the store's one writer holds the lock)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class SqliteStore:
    """SQLite in WAL mode. One writer (the auditor); readers (reports) may run concurrently."""

    kind = "sqlite"

    def __init__(self, path: str | pathlib.Path, *, limits: ReconcileLimits | None = None) -> None:
        self.path = str(path)
        self.limits = limits or ReconcileLimits()
        try:
            if self.path != ":memory:":
                pathlib.Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # a committed high-water mark survives power loss
            had_totals = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='usage_total'").fetchone() is not None
            self.db.executescript(SCHEMA)
            self._migrate()
            if not had_totals:
                self._backfill_totals()
            (self._change,) = self.db.execute("SELECT coalesce(max(change), 0) FROM minute_changes").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open audit store {self.path}: {exc}") from exc

    def _migrate(self) -> None:
        for table, column, definition in MIGRATIONS:
            if column not in {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def _backfill_totals(self) -> None:
        """A store from before the running totals: sum its minutes once and mark them all changed."""
        with transaction(self.db) as db:
            db.execute("INSERT INTO usage_total (tenant, model, input_tokens, output_tokens, requests, events, "
                       "reconciled_input, reconciled_output) SELECT tenant, model, sum(input_tokens), "
                       "sum(output_tokens), sum(requests), sum(events), sum(reconciled_input), sum(reconciled_output) "
                       "FROM usage_minute GROUP BY tenant, model")
            db.execute("INSERT OR REPLACE INTO minute_changes SELECT minute, 1 FROM usage_minute "
                       "UNION SELECT minute, 1 FROM energy_minute")

    def _mark_changed(self, minutes: Iterable[int]) -> None:
        """Inside a transaction: these minutes' usage or energy changed."""
        self._change += 1
        self.db.executemany("INSERT INTO minute_changes VALUES (?, ?) ON CONFLICT (minute) DO UPDATE SET "
                            "change = excluded.change", [(m, self._change) for m in set(minutes)])

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ writing
    def write(self, events: Sequence[TokenEvent], state: Mapping[str, str] | None = None) -> WriteResult:
        """Count each new event once; store ``state`` (resume positions) in the same transaction."""
        try:
            with transaction(self.db) as db:
                fold = fold_events(db, events)
                apply_fold(db, fold)
                if fold.usage:
                    self._mark_changed(k[0] for k in fold.usage)
                db.executemany("INSERT OR REPLACE INTO auditor_state VALUES (?, ?)", list((state or {}).items()))
        except sqlite3.Error as exc:
            raise StoreError(f"audit store write failed: {exc}") from exc
        return WriteResult(fold.written, fold.duplicates)

    def reconcile(self, counters: Mapping[str, Any], now_ns: int | None = None) -> list[Reconciliation]:
        """Compare a runtime's counters snapshot with what the store booked for it; book what is missing.

        ``counters`` is a ``<runtime_id>.counters.json`` document: totals per (tenant, model) as of
        event ``seq``. The caller guarantees every event up to ``seq`` that will ever arrive has been
        written (it drained its source after reading the snapshot). Idempotent: tokens already
        reconciled are not booked twice, and an older snapshot than the last one changes nothing.
        Booking stays within :class:`ReconcileLimits`; the excess is held. A malformed document
        raises :class:`CountersError` and changes nothing.
        """
        doc = parse_counters(counters)
        try:
            with transaction(self.db) as db:
                return reconcile_counters(db, doc, time.time_ns() if now_ns is None else now_ns, self.limits,
                                          self._mark_changed)
        except sqlite3.Error as exc:
            raise StoreError(f"audit store reconcile failed: {exc}") from exc

    def add_energy(self, minute: int, gpu: str, joules: float) -> None:
        try:
            with transaction(self.db) as db:
                db.execute("INSERT INTO energy_minute VALUES (?,?,?) ON CONFLICT (minute, gpu) DO UPDATE SET "
                           "joules = joules + excluded.joules", (minute, gpu, joules))
                self._mark_changed((minute,))
        except sqlite3.Error as exc:
            raise StoreError(f"audit store energy write failed: {exc}") from exc

    def prune(self, detail_before_ns: int, aggregates_before_ns: int | None = None) -> int:
        """Drop detail rows older than ``detail_before_ns`` (and aggregates older than the second bound).

        Each runtime's ``pruned_seq`` rises to the highest seq dropped, so a late replay of a
        pruned event is still recognised as a duplicate.
        """
        try:
            with transaction(self.db) as db:
                db.execute(
                    "UPDATE runtimes SET pruned_seq = max(pruned_seq, (SELECT max(seq) FROM token_events e WHERE "
                    "e.runtime_id = runtimes.runtime_id AND e.wall_ns < ?)) WHERE EXISTS (SELECT 1 FROM token_events "
                    "e WHERE e.runtime_id = runtimes.runtime_id AND e.wall_ns < ?)",
                    (detail_before_ns, detail_before_ns))
                dropped: int = db.execute("DELETE FROM token_events WHERE wall_ns < ?", (detail_before_ns,)).rowcount
                if aggregates_before_ns is not None:
                    for table in ("usage_minute", "energy_minute", "minute_changes"):
                        # running totals keep what the dropped minutes counted (totals are "since the start")
                        db.execute(f"DELETE FROM {table} WHERE minute < ?", (aggregates_before_ns // NS,))
            return dropped
        except sqlite3.Error as exc:
            raise StoreError(f"audit store prune failed: {exc}") from exc

    # ------------------------------------------------------------------ reading
    def state(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM auditor_state WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def set_state(self, items: Mapping[str, str]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO auditor_state VALUES (?, ?)", list(items.items()))

    def usage(self, since_ns: int, until_ns: int | None = None, tenant: str | None = None) -> list[UsageRow]:
        """Usage per (tenant, model) over whole minutes in [since, until), with each tenant's energy share.

        A minute's GPU energy is split between tenants in proportion to their tokens in that minute.
        """
        until = (until_ns if until_ns is not None else time.time_ns() + 60 * NS) // NS
        since = minute_of(since_ns)
        try:
            rows = self.db.execute(
                "SELECT minute, tenant, model, input_tokens, output_tokens, requests, events, reconciled_input, "
                "reconciled_output FROM usage_minute WHERE minute >= ? AND minute < ?", (since, until)).fetchall()
            energy = dict(self.db.execute(
                "SELECT minute, sum(joules) FROM energy_minute WHERE minute >= ? AND minute < ? GROUP BY minute",
                (since, until)).fetchall())
        except sqlite3.Error as exc:
            raise StoreError(f"audit store query failed: {exc}") from exc
        return aggregate_usage(rows, energy, tenant)

    def usage_totals(self, tenant: str | None = None) -> list[UsageRow]:
        """Usage per (tenant, model) since the store began: what ``usage(0)`` returns, read from the running
        totals. Folds in the energy share of the minutes changed since the last call (not the history)."""
        try:
            self._fold_energy()
            sql = ("SELECT tenant, model, input_tokens, output_tokens, requests, events, reconciled_input, "
                   "reconciled_output, energy_joules FROM usage_total")
            rows = self.db.execute(sql + " WHERE tenant=? ORDER BY model", (tenant,)) if tenant is not None else \
                self.db.execute(sql + " ORDER BY tenant, model")
            return [UsageRow(*r) for r in rows]
        except sqlite3.Error as exc:
            raise StoreError(f"audit store query failed: {exc}") from exc

    def _fold_energy(self) -> None:
        with transaction(self.db) as db:
            cursor = int(self.state("totals_change", "0") or 0)
            dirty = db.execute("SELECT minute, change FROM minute_changes WHERE change > ?", (cursor,)).fetchall()
            shares: list[tuple[float, int, str, str]] = []
            deltas: dict[tuple[str, str], float] = {}
            for minute, _ in dirty:
                (energy,) = db.execute("SELECT coalesce(sum(joules), 0) FROM energy_minute WHERE minute=?",
                                       (minute,)).fetchone()
                rows = db.execute("SELECT tenant, model, input_tokens + output_tokens + reconciled_input + "
                                  "reconciled_output, energy_share FROM usage_minute WHERE minute=?",
                                  (minute,)).fetchall()
                total = sum(r[2] for r in rows)
                for tenant, model, tokens, old in rows:
                    new = energy * tokens / total if total else 0.0  # the same split as aggregate_usage
                    if new != old:
                        shares.append((new, minute, tenant, model))
                        deltas[(tenant, model)] = deltas.get((tenant, model), 0.0) + new - old
            db.executemany("UPDATE usage_minute SET energy_share=? WHERE minute=? AND tenant=? AND model=?", shares)
            db.executemany("UPDATE usage_total SET energy_joules = energy_joules + ? WHERE tenant=? AND model=?",
                           [(d, *k) for k, d in deltas.items()])
            if dirty:
                db.execute("INSERT OR REPLACE INTO auditor_state VALUES ('totals_change', ?)",
                           (str(max(c for _, c in dirty)),))

    def totals(self) -> dict[str, Any]:
        """Whole-store figures for status and tests: events, duplicates impossible by key, gaps, ledger."""
        db = self.db
        runtimes = [dict(zip(("runtime_id", "pid", "hwm", "events", "pruned_seq", "counters_seq", "final"), r))
                    for r in db.execute("SELECT runtime_id, pid, hwm, events, pruned_seq, counters_seq, final "
                                        "FROM runtimes ORDER BY first_ns")]
        for r in runtimes:
            # Events that never reached the store: seq gaps, and the tail the runtime's counters saw beyond hwm.
            r["missing"] = max(r["hwm"], r["counters_seq"]) - r["events"]
        columns = ("runtime_id", "tenant", "model", "input_tokens", "output_tokens", "events", "requests",
                   "reconciled_input", "reconciled_output", "reconciled_events", "held_input", "held_output",
                   "held_events")
        ledger = [dict(zip(columns, r)) for r in db.execute(
            f"SELECT {', '.join(columns)} FROM runtime_ledger ORDER BY runtime_id, tenant, model")]
        recon = [dict(zip(("at_ns", "runtime_id", "tenant", "model", "counters_seq", "input_tokens",
                           "output_tokens", "events", "kind"), r))
                 for r in db.execute("SELECT * FROM reconciliations ORDER BY at_ns")]
        return {"runtimes": runtimes, "ledger": ledger, "reconciliations": recon}


def aggregate_usage(rows: Iterable[Sequence[Any]], energy: Mapping[int, float],
                    tenant: str | None) -> list[UsageRow]:
    """Shared by both stores: fold minute rows into per (tenant, model) rows with the energy share."""
    per_minute_tokens: dict[int, int] = {}
    materialised = list(rows)
    for m, _t, _mo, i, o, _rq, _ev, ri, ro in materialised:
        per_minute_tokens[m] = per_minute_tokens.get(m, 0) + i + o + ri + ro
    out: dict[tuple[str, str], list[float]] = {}
    for m, t, mo, i, o, rq, ev, ri, ro in materialised:
        if tenant is not None and t != tenant:
            continue
        acc = out.setdefault((t, mo), [0, 0, 0, 0, 0, 0, 0.0])
        for k, v in enumerate((i, o, rq, ev, ri, ro)):
            acc[k] += v
        total = per_minute_tokens.get(m, 0)
        if total:
            acc[6] += energy.get(m, 0.0) * (i + o + ri + ro) / total
    return [UsageRow(t, mo, int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), float(a[6]))
            for (t, mo), a in sorted(out.items())]
