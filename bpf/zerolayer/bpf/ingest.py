"""One batch of token events into the audit store: which are new, and what the new ones add.

:func:`fold_events` decides, event by event, what is new (above a runtime's high-water mark and not
seen twice in the batch, or a late event whose key the store does not hold yet) and sums what the new
ones add per minute, per ledger key and per runtime; :func:`apply_fold` writes those sums. Both run
inside the store's write transaction (:meth:`zerolayer.bpf.store.SqliteStore.write`), so a batch is
counted whole or not at all.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from typing import Any, Iterable

from zerolayer.bpf.errors import StoreError
from zerolayer.bpf.events import FLAG_FIRST, TokenEvent, minute_of

INSERT_EVENT = ("INSERT INTO token_events VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT (runtime_id, seq) DO NOTHING")

# Each upsert adds the new row's counters to the stored ones: "<column> = <column> + excluded.<column>".
_ADD_TOKENS = ("input_tokens = input_tokens + excluded.input_tokens, "
               "output_tokens = output_tokens + excluded.output_tokens, "
               "requests = requests + excluded.requests, events = events + excluded.events")
UPSERT_MINUTE = ("INSERT INTO usage_minute (minute, tenant, model, input_tokens, output_tokens, requests, events) "
                 "VALUES (?,?,?,?,?,?,?) ON CONFLICT (minute, tenant, model) DO UPDATE SET " + _ADD_TOKENS)
UPSERT_TOTAL = ("INSERT INTO usage_total (tenant, model, input_tokens, output_tokens, requests, events) "
                "VALUES (?,?,?,?,?,?) ON CONFLICT (tenant, model) DO UPDATE SET " + _ADD_TOKENS)
UPSERT_LEDGER = ("INSERT INTO runtime_ledger (runtime_id, tenant, model, input_tokens, output_tokens, requests, "
                 "events) VALUES (?,?,?,?,?,?,?) ON CONFLICT (runtime_id, tenant, model) DO UPDATE SET " + _ADD_TOKENS)
UPSERT_RUNTIME = (
    "INSERT INTO runtimes (runtime_id, pid, hwm, events, first_ns, last_ns) VALUES (?,?,?,?,?,?) "
    "ON CONFLICT (runtime_id) DO UPDATE SET hwm = max(hwm, excluded.hwm), events = events + excluded.events, "
    "first_ns = CASE WHEN first_ns = 0 THEN excluded.first_ns ELSE min(first_ns, excluded.first_ns) END, "
    "last_ns = max(last_ns, excluded.last_ns), pid = excluded.pid")


@dataclasses.dataclass
class Fold:
    """What a batch's new events add. Counters are lists ``[input, output, requests, events]``."""

    written: int = 0  # new events, counted now
    duplicates: int = 0  # already in the store (replays), not counted again
    usage: dict[tuple[int, str, str], list[int]] = dataclasses.field(default_factory=dict)  # (minute, tenant, model)
    ledger: dict[tuple[str, str, str], list[int]] = dataclasses.field(default_factory=dict)  # (runtime, tenant, model)
    runtimes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # id -> [pid, hwm, events, first, last]
    fresh: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)  # above the mark: new by construction

    def count(self, rid: str, seq: int, wall: int, tenant: str, model: str, tokens: tuple[int, int, int],
              pid: int) -> None:
        """Add one new event: ``tokens`` is (input, output, 1 if it opens a request else 0)."""
        # Inline, no helper calls: this runs once per event (bench/audit_store.py).
        self.written += 1
        inp, out, req = tokens
        key = (minute_of(wall), tenant, model)
        u = self.usage.get(key)
        if u is None:
            u = self.usage[key] = [0, 0, 0, 0]
        ledger_key = (rid, tenant, model)
        lg = self.ledger.get(ledger_key)
        if lg is None:
            lg = self.ledger[ledger_key] = [0, 0, 0, 0]
        for acc in (u, lg):
            acc[0] += inp
            acc[1] += out
            acc[2] += req
            acc[3] += 1
        r = self.runtimes.get(rid)
        if r is None:
            self.runtimes[rid] = [pid, seq, 1, wall, wall]
            return
        if seq > r[1]:
            r[1] = seq
        r[2] += 1
        if wall < r[3]:
            r[3] = wall
        elif wall > r[4]:
            r[4] = wall

    def totals(self) -> dict[tuple[str, str], list[int]]:
        """The usage summed over minutes, per (tenant, model): what the running totals gain."""
        totals: dict[tuple[str, str], list[int]] = {}
        for (_minute, tenant, model), v in self.usage.items():
            t = totals.setdefault((tenant, model), [0, 0, 0, 0])
            for k in range(4):
                t[k] += v[k]
        return totals


def _marks(db: sqlite3.Connection, rid: str) -> tuple[int, int]:
    """A runtime's ``(pruned_seq, hwm)``: what is surely old, and above what everything is new."""
    row = db.execute("SELECT pruned_seq, hwm FROM runtimes WHERE runtime_id=?", (rid,)).fetchone()
    return (row[0], row[1]) if row else (0, 0)


def fold_events(db: sqlite3.Connection, events: Iterable[TokenEvent]) -> Fold:
    """Inside a transaction: decide which events are new and sum what they add. A late event at or below
    its runtime's mark is inserted here (its key decides); the fresh ones wait for :func:`apply_fold`."""
    fold = Fold()
    marks: dict[int, tuple[str, int, int]] = {}  # runtime_id -> (its hex id, pruned_seq, hwm)
    seen: set[tuple[str, int]] = set()
    # One pass, tuple-unpacked (attribute access on a named tuple costs more than the rest of the loop).
    for values in events:
        runtime_id, seq, wall, tenant, model, _request, inp, out, flags, pid, _cgroup, _source = values
        mark = marks.get(runtime_id)
        if mark is None:
            rid = f"{runtime_id:016x}"
            mark = marks[runtime_id] = (rid, *_marks(db, rid))
        rid, pruned, hwm = mark
        # At or below the mark: a replay, or a late event filling a gap; ask the key. ON CONFLICT, not
        # OR IGNORE: only a replayed key is skipped, other violations abort.
        if seq <= pruned or (seq > hwm and (rid, seq) in seen) or (
                seq <= hwm and db.execute(INSERT_EVENT, (rid, *values[1:])).rowcount == 0):
            fold.duplicates += 1
            continue
        if seq > hwm:
            seen.add((rid, seq))
            fold.fresh.append((rid, *values[1:]))
        fold.count(rid, seq, wall, tenant, model, (inp, out, flags & FLAG_FIRST), pid)
    return fold


def apply_fold(db: sqlite3.Connection, fold: Fold) -> None:
    """Inside the same transaction: insert the fresh events and add the sums to the aggregates, the
    running totals, the ledger and the runtimes' marks."""
    if fold.fresh:
        before = db.total_changes
        db.executemany(INSERT_EVENT, fold.fresh)
        if db.total_changes - before != len(fold.fresh):
            raise StoreError("events above the high-water mark were already stored: the store is corrupt")
    db.executemany(UPSERT_MINUTE, [(*k, *v) for k, v in fold.usage.items()])
    db.executemany(UPSERT_TOTAL, [(*k, *v) for k, v in fold.totals().items()])
    db.executemany(UPSERT_LEDGER, [(*k, *v) for k, v in fold.ledger.items()])
    db.executemany(UPSERT_RUNTIME, [(k, *v) for k, v in fold.runtimes.items()])
