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

import dataclasses
import pathlib
import sqlite3
import time
from typing import Any, Iterable, Mapping, Sequence

from zerolayer.bpf.errors import CountersError, StoreError
from zerolayer.bpf.events import FLAG_FIRST, TokenEvent

NS = 1_000_000_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS token_events (
    runtime_id TEXT NOT NULL, seq INTEGER NOT NULL, wall_ns INTEGER NOT NULL,
    tenant TEXT NOT NULL, model TEXT NOT NULL, request_id TEXT NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, flags INTEGER NOT NULL,
    pid INTEGER NOT NULL, cgroup_id INTEGER NOT NULL, source TEXT NOT NULL,
    PRIMARY KEY (runtime_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS token_events_time ON token_events (wall_ns);
CREATE TABLE IF NOT EXISTS usage_minute (
    minute INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0, events INTEGER NOT NULL DEFAULT 0,
    reconciled_input INTEGER NOT NULL DEFAULT 0, reconciled_output INTEGER NOT NULL DEFAULT 0,
    energy_share REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, tenant, model)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_minute_tenant ON usage_minute (tenant, minute);
CREATE TABLE IF NOT EXISTS usage_total (
    tenant TEXT NOT NULL, model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0, events INTEGER NOT NULL DEFAULT 0,
    reconciled_input INTEGER NOT NULL DEFAULT 0, reconciled_output INTEGER NOT NULL DEFAULT 0,
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
class ReconcileLimits:
    """How much a runtime's counters may book beyond its events (the counters come from the server
    container, which the auditor does not trust with billing).

    Per (runtime, tenant, model), reconciled tokens stay within ``max(min_tokens, max_ratio x tokens
    metered from events)``, and the missing events a snapshot claims must fit the runtime's sequence
    gaps. What exceeds either is *held*: recorded (kind ``held``), counted, never billed.
    """

    max_ratio: float = 1.0
    min_tokens: int = 100_000


def _count(doc: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 1 << 63:
        raise CountersError(f"{key} must be a non-negative integer, not {value!r}")
    return value


def parse_counters(doc: Any) -> dict[str, Any]:
    """A validated copy of a ``<runtime_id>.counters.json`` document, or :class:`CountersError`."""
    if not isinstance(doc, Mapping):
        raise CountersError(f"expected a JSON object, not {type(doc).__name__}")
    rid = doc.get("runtime_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= 64:
        raise CountersError(f"runtime_id must be a non-empty string, not {rid!r}")
    totals = doc.get("totals", [])
    if not isinstance(totals, list):
        raise CountersError("totals must be a list")
    rows = []
    for t in totals:
        if not isinstance(t, Mapping) or not isinstance(t.get("tenant"), str) or not isinstance(t.get("model"), str):
            raise CountersError(f"a totals entry needs string tenant and model: {t!r:.200}")
        rows.append({"tenant": t["tenant"], "model": t["model"], "input_tokens": _count(t, "input_tokens"),
                     "output_tokens": _count(t, "output_tokens"), "events": _count(t, "events"),
                     "requests": _count(t, "requests", 0)})
    if len({(r["tenant"], r["model"]) for r in rows}) != len(rows):
        raise CountersError("totals name the same tenant and model twice")
    return {"runtime_id": rid, "pid": _count(doc, "pid", 0), "seq": _count(doc, "seq"),
            "written_ns": _count(doc, "written_ns", 0), "started_ns": _count(doc, "started_ns", 0),
            "final": bool(doc.get("final")), "totals": rows}


@dataclasses.dataclass(frozen=True)
class Reconciliation:
    runtime_id: str
    tenant: str
    model: str
    counters_seq: int
    input_tokens: int  # > 0: booked from the counters; < 0: the store holds more than the runtime counted
    output_tokens: int
    events: int
    # "reconciled" (missing events booked) | "disagreement" (store above counters) | "held" (claimed beyond
    # ReconcileLimits: the amounts are what is held now, not billed)
    kind: str


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


def minute_of(wall_ns: int) -> int:
    return wall_ns // NS // 60 * 60


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
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT INTO usage_total (tenant, model, input_tokens, output_tokens, requests, events, "
                       "reconciled_input, reconciled_output) SELECT tenant, model, sum(input_tokens), "
                       "sum(output_tokens), sum(requests), sum(events), sum(reconciled_input), sum(reconciled_output) "
                       "FROM usage_minute GROUP BY tenant, model")
            db.execute("INSERT OR REPLACE INTO minute_changes SELECT minute, 1 FROM usage_minute "
                       "UNION SELECT minute, 1 FROM energy_minute")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

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
            return self._write(events, state or {})
        except sqlite3.Error as exc:
            raise StoreError(f"audit store write failed: {exc}") from exc

    def _write(self, events: Sequence[TokenEvent], state: Mapping[str, str]) -> WriteResult:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            pruned: dict[str, int] = {}
            usage: dict[tuple[int, str, str], list[int]] = {}
            ledger: dict[tuple[str, str, str], list[int]] = {}
            runtimes: dict[str, list[int]] = {}  # id -> [pid, hwm, events, first_ns, last_ns]
            written = duplicates = 0
            hwm: dict[str, int] = {}
            fresh: list[tuple[Any, ...]] = []  # above the runtime's high-water mark: new by construction
            seen: set[tuple[str, int]] = set()
            ids: dict[int, str] = {}
            insert = ("INSERT INTO token_events VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
                      "ON CONFLICT (runtime_id, seq) DO NOTHING")
            # One pass, tuple-unpacked (attribute access on a named tuple costs more than the rest of the loop).
            for values in events:
                runtime_id, seq, wall, tenant, model, _request, inp, out, flags, pid, _cgroup, _source = values
                rid = ids.get(runtime_id)
                if rid is None:
                    rid = ids[runtime_id] = f"{runtime_id:016x}"
                    row = db.execute("SELECT pruned_seq, hwm FROM runtimes WHERE runtime_id=?", (rid,)).fetchone()
                    pruned[rid], hwm[rid] = row if row else (0, 0)
                if seq <= pruned[rid]:
                    duplicates += 1
                    continue
                if seq > hwm[rid]:
                    if (rid, seq) in seen:  # the same event twice in one batch
                        duplicates += 1
                        continue
                    seen.add((rid, seq))
                    fresh.append((rid, *values[1:]))
                # At or below the mark: a replay, or a late event filling a gap. Ask the key.
                # ON CONFLICT, not OR IGNORE: only a replayed key is skipped; other violations abort.
                elif db.execute(insert, (rid, *values[1:])).rowcount == 0:
                    duplicates += 1
                    continue
                written += 1
                req = flags & FLAG_FIRST
                key = (minute_of(wall), tenant, model)
                u = usage.get(key)
                if u is None:
                    u = usage[key] = [0, 0, 0, 0]
                u[0] += inp
                u[1] += out
                u[2] += req
                u[3] += 1
                key = (rid, tenant, model)
                lg = ledger.get(key)
                if lg is None:
                    lg = ledger[key] = [0, 0, 0, 0]
                lg[0] += inp
                lg[1] += out
                lg[2] += 1
                lg[3] += req
                r = runtimes.get(rid)
                if r is None:
                    runtimes[rid] = [pid, seq, 1, wall, wall]
                else:
                    if seq > r[1]:
                        r[1] = seq
                    r[2] += 1
                    if wall < r[3]:
                        r[3] = wall
                    elif wall > r[4]:
                        r[4] = wall
            if fresh:
                before = db.total_changes
                db.executemany(insert, fresh)
                if db.total_changes - before != len(fresh):
                    raise StoreError("events above the high-water mark were already stored: the store is corrupt")
            db.executemany(
                "INSERT INTO usage_minute (minute, tenant, model, input_tokens, output_tokens, requests, events) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT (minute, tenant, model) DO UPDATE SET "
                "input_tokens = input_tokens + excluded.input_tokens, "
                "output_tokens = output_tokens + excluded.output_tokens, "
                "requests = requests + excluded.requests, events = events + excluded.events",
                [(*k, *v) for k, v in usage.items()])
            totals: dict[tuple[str, str], list[int]] = {}
            for (_minute, tenant, model), v in usage.items():
                t = totals.get((tenant, model))
                if t is None:
                    totals[(tenant, model)] = list(v)
                else:
                    for k in range(4):
                        t[k] += v[k]
            db.executemany(
                "INSERT INTO usage_total (tenant, model, input_tokens, output_tokens, requests, events) "
                "VALUES (?,?,?,?,?,?) ON CONFLICT (tenant, model) DO UPDATE SET "
                "input_tokens = input_tokens + excluded.input_tokens, "
                "output_tokens = output_tokens + excluded.output_tokens, "
                "requests = requests + excluded.requests, events = events + excluded.events",
                [(*k, *v) for k, v in totals.items()])
            if usage:
                self._mark_changed(k[0] for k in usage)
            db.executemany(
                "INSERT INTO runtime_ledger (runtime_id, tenant, model, input_tokens, output_tokens, events, requests) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT (runtime_id, tenant, model) DO UPDATE SET "
                "input_tokens = input_tokens + excluded.input_tokens, "
                "output_tokens = output_tokens + excluded.output_tokens, "
                "events = events + excluded.events, requests = requests + excluded.requests",
                [(*k, *v) for k, v in ledger.items()])
            db.executemany(
                "INSERT INTO runtimes (runtime_id, pid, hwm, events, first_ns, last_ns) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT (runtime_id) DO UPDATE SET hwm = max(hwm, excluded.hwm), "
                "events = events + excluded.events, "
                "first_ns = CASE WHEN first_ns = 0 THEN excluded.first_ns ELSE min(first_ns, excluded.first_ns) END, "
                "last_ns = max(last_ns, excluded.last_ns), pid = excluded.pid",
                [(k, *v) for k, v in runtimes.items()])
            db.executemany("INSERT OR REPLACE INTO auditor_state VALUES (?, ?)", list(state.items()))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return WriteResult(written, duplicates)

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
            return self._reconcile(doc, time.time_ns() if now_ns is None else now_ns)
        except sqlite3.Error as exc:
            raise StoreError(f"audit store reconcile failed: {exc}") from exc

    def _reconcile(self, counters: Mapping[str, Any], now_ns: int) -> list[Reconciliation]:
        db = self.db
        rid = counters["runtime_id"]
        seq = counters["seq"]
        found: list[Reconciliation] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT counters_seq, events FROM runtimes WHERE runtime_id=?", (rid,)).fetchone()
            if row is not None and row[0] >= seq and not counters["final"]:
                db.execute("COMMIT")
                return found
            after = {(t, m): (i, o, n) for t, m, i, o, n in db.execute(
                "SELECT tenant, model, sum(input_tokens), sum(output_tokens), count(*) FROM token_events "
                "WHERE runtime_id=? AND seq>? GROUP BY tenant, model", (rid, seq))}
            # Sequence numbers up to seq that no stored or already reconciled event accounts for: the most
            # missing events any snapshot can claim.
            stored = (row[1] if row else 0) - sum(a[2] for a in after.values())
            (reconciled_events,) = db.execute("SELECT coalesce(sum(reconciled_events), 0) FROM runtime_ledger "
                                              "WHERE runtime_id=?", (rid,)).fetchone()
            gaps = seq - stored - reconciled_events
            minute = minute_of(counters["written_ns"] or now_ns)
            for t in counters["totals"]:
                key = (t["tenant"], t["model"])
                lg = db.execute(
                    "SELECT input_tokens, output_tokens, events, reconciled_input, reconciled_output, "
                    "reconciled_events, held_input, held_output, held_events FROM runtime_ledger "
                    "WHERE runtime_id=? AND tenant=? AND model=?", (rid, *key)).fetchone() or (0,) * 9
                a = after.get(key, (0, 0, 0))
                d_in = t["input_tokens"] - (lg[0] - a[0]) - lg[3]
                d_out = t["output_tokens"] - (lg[1] - a[1]) - lg[4]
                d_ev = t["events"] - (lg[2] - a[2]) - lg[5]
                if d_in < 0 or d_out < 0 or d_ev < 0:
                    found.append(Reconciliation(rid, *key, seq, d_in, d_out, d_ev, "disagreement"))
                    continue
                b_in, b_out, b_ev = self._bookable(d_in, d_out, d_ev, gaps, metered=lg[0] + lg[1],
                                                   reconciled=lg[3] + lg[4])
                gaps -= b_ev
                held = (d_in - b_in, d_out - b_out, d_ev - b_ev)
                if held != tuple(lg[6:9]):
                    found.append(Reconciliation(rid, *key, seq, *held, "held"))
                if b_in or b_out or b_ev:
                    found.append(Reconciliation(rid, *key, seq, b_in, b_out, b_ev, "reconciled"))
                    db.execute(
                        "INSERT INTO usage_minute (minute, tenant, model, reconciled_input, reconciled_output) "
                        "VALUES (?,?,?,?,?) ON CONFLICT (minute, tenant, model) DO UPDATE SET "
                        "reconciled_input = reconciled_input + excluded.reconciled_input, "
                        "reconciled_output = reconciled_output + excluded.reconciled_output",
                        (minute, *key, b_in, b_out))
                    db.execute(
                        "INSERT INTO usage_total (tenant, model, reconciled_input, reconciled_output) VALUES (?,?,?,?) "
                        "ON CONFLICT (tenant, model) DO UPDATE SET "
                        "reconciled_input = reconciled_input + excluded.reconciled_input, "
                        "reconciled_output = reconciled_output + excluded.reconciled_output", (*key, b_in, b_out))
                    self._mark_changed((minute,))
                if held != tuple(lg[6:9]) or b_in or b_out or b_ev:
                    db.execute(
                        "INSERT INTO runtime_ledger (runtime_id, tenant, model, reconciled_input, reconciled_output, "
                        "reconciled_events, held_input, held_output, held_events) VALUES (?,?,?,?,?,?,?,?,?) "
                        "ON CONFLICT (runtime_id, tenant, model) DO UPDATE SET "
                        "reconciled_input = reconciled_input + excluded.reconciled_input, "
                        "reconciled_output = reconciled_output + excluded.reconciled_output, "
                        "reconciled_events = reconciled_events + excluded.reconciled_events, "
                        "held_input = excluded.held_input, held_output = excluded.held_output, "
                        "held_events = excluded.held_events",
                        (rid, *key, b_in, b_out, b_ev, *held))
            db.executemany("INSERT INTO reconciliations VALUES (?,?,?,?,?,?,?,?,?)",
                           [(now_ns, r.runtime_id, r.tenant, r.model, r.counters_seq, r.input_tokens,
                             r.output_tokens, r.events, r.kind) for r in found])
            db.execute(
                "INSERT INTO runtimes (runtime_id, pid, counters_seq, final) VALUES (?,?,?,?) "
                "ON CONFLICT (runtime_id) DO UPDATE SET counters_seq = max(counters_seq, excluded.counters_seq), "
                "final = max(final, excluded.final)",
                (rid, counters["pid"], seq, 1 if counters["final"] else 0))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return found

    def _bookable(self, d_in: int, d_out: int, d_ev: int, gaps: int, *, metered: int,
                  reconciled: int) -> tuple[int, int, int]:
        """The part of a claim (missing input, output tokens, events) that may be booked now."""
        if d_ev > gaps:  # more missing events than unexplained sequence numbers: nothing of it is believable
            return 0, 0, 0
        room = max(0, max(self.limits.min_tokens, int(self.limits.max_ratio * metered)) - reconciled)
        if d_in + d_out <= room:
            return d_in, d_out, d_ev
        b_in = min(d_in, room)
        return b_in, min(d_out, room - b_in), 0  # events are booked with the last of their tokens

    def add_energy(self, minute: int, gpu: str, joules: float) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("INSERT INTO energy_minute VALUES (?,?,?) ON CONFLICT (minute, gpu) DO UPDATE SET "
                                "joules = joules + excluded.joules", (minute, gpu, joules))
                self._mark_changed((minute,))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"audit store energy write failed: {exc}") from exc

    def prune(self, detail_before_ns: int, aggregates_before_ns: int | None = None) -> int:
        """Drop detail rows older than ``detail_before_ns`` (and aggregates older than the second bound).

        Each runtime's ``pruned_seq`` rises to the highest seq dropped, so a late replay of a
        pruned event is still recognised as a duplicate.
        """
        try:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "UPDATE runtimes SET pruned_seq = max(pruned_seq, (SELECT max(seq) FROM token_events e WHERE "
                    "e.runtime_id = runtimes.runtime_id AND e.wall_ns < ?)) WHERE EXISTS (SELECT 1 FROM token_events "
                    "e WHERE e.runtime_id = runtimes.runtime_id AND e.wall_ns < ?)",
                    (detail_before_ns, detail_before_ns))
                dropped = db.execute("DELETE FROM token_events WHERE wall_ns < ?", (detail_before_ns,)).rowcount
                if aggregates_before_ns is not None:
                    db.execute("DELETE FROM usage_minute WHERE minute < ?", (aggregates_before_ns // NS,))
                    db.execute("DELETE FROM energy_minute WHERE minute < ?", (aggregates_before_ns // NS,))
                    # running totals keep what the dropped minutes counted (totals are "since the start")
                    db.execute("DELETE FROM minute_changes WHERE minute < ?", (aggregates_before_ns // NS,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
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
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            cursor = int(self.state("totals_change", "0") or 0)
            dirty = db.execute("SELECT minute, change FROM minute_changes WHERE change > ?", (cursor,)).fetchall()
            shares, deltas = [], {}
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
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

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
