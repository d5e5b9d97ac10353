"""The audit store: token events in, per tenant/model/minute usage out, each event counted once.

Schema (the same tables in SQLite and ClickHouse, see :mod:`zerolayer.bpf.clickhouse`):

``token_events``   detail, one row per event, key ``(runtime_id, seq)``; pruned after the retention.
``usage_minute``   aggregates per (minute, tenant, model): tokens from events plus ``reconciled_*``
                   tokens booked from the runtime's counters for events that never arrived.
``runtimes``       per runtime instance: high-water mark ``hwm`` (highest seq written), events
                   written, ``pruned_seq`` (detail below it was pruned), last counters seq reconciled.
``runtime_ledger`` per (runtime, tenant, model): cumulative booked and reconciled tokens -- what the
                   runtime's own counters are compared with.
``reconciliations`` one row per adjustment or disagreement found.
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

from zerolayer.bpf.errors import StoreError
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
    PRIMARY KEY (minute, tenant, model)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_minute_tenant ON usage_minute (tenant, minute);
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


@dataclasses.dataclass(frozen=True)
class Reconciliation:
    runtime_id: str
    tenant: str
    model: str
    counters_seq: int
    input_tokens: int  # > 0: booked from the counters; < 0: the store holds more than the runtime counted
    output_tokens: int
    events: int
    kind: str  # "reconciled" (missing events booked) | "disagreement" (store above counters)


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

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = str(path)
        try:
            if self.path != ":memory:":
                pathlib.Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # a committed high-water mark survives power loss
            self.db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open audit store {self.path}: {exc}") from exc

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
        """
        try:
            return self._reconcile(counters, time.time_ns() if now_ns is None else now_ns)
        except sqlite3.Error as exc:
            raise StoreError(f"audit store reconcile failed: {exc}") from exc

    def _reconcile(self, counters: Mapping[str, Any], now_ns: int) -> list[Reconciliation]:
        db = self.db
        rid = str(counters["runtime_id"])
        seq = int(counters["seq"])
        found: list[Reconciliation] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT counters_seq FROM runtimes WHERE runtime_id=?", (rid,)).fetchone()
            if row is not None and row[0] >= seq and not counters.get("final"):
                db.execute("COMMIT")
                return found
            after = {(t, m): (i, o, n) for t, m, i, o, n in db.execute(
                "SELECT tenant, model, sum(input_tokens), sum(output_tokens), count(*) FROM token_events "
                "WHERE runtime_id=? AND seq>? GROUP BY tenant, model", (rid, seq))}
            minute = minute_of(int(counters.get("written_ns") or now_ns))
            for t in counters.get("totals", ()):
                key = (t["tenant"], t["model"])
                lg = db.execute(
                    "SELECT input_tokens, output_tokens, events, reconciled_input, reconciled_output, "
                    "reconciled_events FROM runtime_ledger WHERE runtime_id=? AND tenant=? AND model=?",
                    (rid, *key)).fetchone() or (0, 0, 0, 0, 0, 0)
                a = after.get(key, (0, 0, 0))
                d_in = int(t["input_tokens"]) - (lg[0] - a[0]) - lg[3]
                d_out = int(t["output_tokens"]) - (lg[1] - a[1]) - lg[4]
                d_ev = int(t["events"]) - (lg[2] - a[2]) - lg[5]
                if d_in == d_out == d_ev == 0:
                    continue
                if d_in < 0 or d_out < 0 or d_ev < 0:
                    found.append(Reconciliation(rid, *key, seq, d_in, d_out, d_ev, "disagreement"))
                    continue
                found.append(Reconciliation(rid, *key, seq, d_in, d_out, d_ev, "reconciled"))
                db.execute(
                    "INSERT INTO runtime_ledger (runtime_id, tenant, model, reconciled_input, reconciled_output, "
                    "reconciled_events) VALUES (?,?,?,?,?,?) ON CONFLICT (runtime_id, tenant, model) DO UPDATE SET "
                    "reconciled_input = reconciled_input + excluded.reconciled_input, "
                    "reconciled_output = reconciled_output + excluded.reconciled_output, "
                    "reconciled_events = reconciled_events + excluded.reconciled_events",
                    (rid, *key, d_in, d_out, d_ev))
                db.execute(
                    "INSERT INTO usage_minute (minute, tenant, model, reconciled_input, reconciled_output) "
                    "VALUES (?,?,?,?,?) ON CONFLICT (minute, tenant, model) DO UPDATE SET "
                    "reconciled_input = reconciled_input + excluded.reconciled_input, "
                    "reconciled_output = reconciled_output + excluded.reconciled_output",
                    (minute, *key, d_in, d_out))
            db.executemany("INSERT INTO reconciliations VALUES (?,?,?,?,?,?,?,?,?)",
                           [(now_ns, r.runtime_id, r.tenant, r.model, r.counters_seq, r.input_tokens,
                             r.output_tokens, r.events, r.kind) for r in found])
            db.execute(
                "INSERT INTO runtimes (runtime_id, pid, counters_seq, final) VALUES (?,?,?,?) "
                "ON CONFLICT (runtime_id) DO UPDATE SET counters_seq = max(counters_seq, excluded.counters_seq), "
                "final = max(final, excluded.final)",
                (rid, int(counters.get("pid", 0)), seq, 1 if counters.get("final") else 0))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return found

    def add_energy(self, minute: int, gpu: str, joules: float) -> None:
        try:
            self.db.execute("INSERT INTO energy_minute VALUES (?,?,?) ON CONFLICT (minute, gpu) DO UPDATE SET "
                            "joules = joules + excluded.joules", (minute, gpu, joules))
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

    def totals(self) -> dict[str, Any]:
        """Whole-store figures for status and tests: events, duplicates impossible by key, gaps, ledger."""
        db = self.db
        runtimes = [dict(zip(("runtime_id", "pid", "hwm", "events", "pruned_seq", "counters_seq", "final"), r))
                    for r in db.execute("SELECT runtime_id, pid, hwm, events, pruned_seq, counters_seq, final "
                                        "FROM runtimes ORDER BY first_ns")]
        for r in runtimes:
            # Events that never reached the store: seq gaps, and the tail the runtime's counters saw beyond hwm.
            r["missing"] = max(r["hwm"], r["counters_seq"]) - r["events"]
        ledger = [dict(zip(("runtime_id", "tenant", "model", "input_tokens", "output_tokens", "events", "requests",
                            "reconciled_input", "reconciled_output", "reconciled_events"), r))
                  for r in db.execute("SELECT * FROM runtime_ledger ORDER BY runtime_id, tenant, model")]
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
