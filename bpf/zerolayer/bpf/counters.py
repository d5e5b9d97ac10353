"""A runtime's own counters against what the audit store booked for it.

A runtime writes ``<runtime_id>.counters.json``: totals per (tenant, model) as of event ``seq``. What
those totals claim beyond the events the store holds is booked as *reconciled* tokens, within
:class:`ReconcileLimits` and the runtime's sequence gaps; the excess is *held* (recorded, never billed);
a store above the counters is a *disagreement*. :func:`reconcile_counters` runs inside the store's
transaction (:meth:`zerolayer.bpf.store.SqliteStore.reconcile`).
"""

from __future__ import annotations

import dataclasses
import sqlite3
from typing import Any, Callable, Iterable, Mapping

from zerolayer.bpf.errors import CountersError
from zerolayer.bpf.events import minute_of

Claim = tuple[int, int, int]  # input tokens, output tokens, events

_LEDGER = ("SELECT input_tokens, output_tokens, events, reconciled_input, reconciled_output, reconciled_events, "
           "held_input, held_output, held_events FROM runtime_ledger WHERE runtime_id=? AND tenant=? AND model=?")
_ADD_RECONCILED = ("reconciled_input = reconciled_input + excluded.reconciled_input, "
                   "reconciled_output = reconciled_output + excluded.reconciled_output")
_BOOK_MINUTE = ("INSERT INTO usage_minute (minute, tenant, model, reconciled_input, reconciled_output) "
                "VALUES (?,?,?,?,?) ON CONFLICT (minute, tenant, model) DO UPDATE SET " + _ADD_RECONCILED)
_BOOK_TOTAL = ("INSERT INTO usage_total (tenant, model, reconciled_input, reconciled_output) VALUES (?,?,?,?) "
               "ON CONFLICT (tenant, model) DO UPDATE SET " + _ADD_RECONCILED)
_BOOK_LEDGER = (
    "INSERT INTO runtime_ledger (runtime_id, tenant, model, reconciled_input, reconciled_output, reconciled_events, "
    "held_input, held_output, held_events) VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT (runtime_id, tenant, model) "
    "DO UPDATE SET " + _ADD_RECONCILED + ", reconciled_events = reconciled_events + excluded.reconciled_events, "
    "held_input = excluded.held_input, held_output = excluded.held_output, held_events = excluded.held_events")
_RECORD_RUNTIME = (
    "INSERT INTO runtimes (runtime_id, pid, counters_seq, final) VALUES (?,?,?,?) ON CONFLICT (runtime_id) DO "
    "UPDATE SET counters_seq = max(counters_seq, excluded.counters_seq), final = max(final, excluded.final)")


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


def bookable(limits: ReconcileLimits, claim: Claim, gaps: int, *, metered: int, reconciled: int) -> Claim:
    """The part of a claim (missing input, output tokens, events) that may be booked now."""
    d_in, d_out, d_ev = claim
    if d_ev > gaps:  # more missing events than unexplained sequence numbers: nothing of it is believable
        return 0, 0, 0
    room = max(0, max(limits.min_tokens, int(limits.max_ratio * metered)) - reconciled)
    if d_in + d_out <= room:
        return d_in, d_out, d_ev
    b_in = min(d_in, room)
    return b_in, min(d_out, room - b_in), 0  # events are booked with the last of their tokens


def _events_after(db: sqlite3.Connection, rid: str, seq: int) -> dict[tuple[str, str], Claim]:
    """Per (tenant, model), the stored events past the snapshot's ``seq`` (the counters do not hold them yet)."""
    return {(t, m): (i, o, n) for t, m, i, o, n in db.execute(
        "SELECT tenant, model, sum(input_tokens), sum(output_tokens), count(*) FROM token_events "
        "WHERE runtime_id=? AND seq>? GROUP BY tenant, model", (rid, seq))}


def _gaps(db: sqlite3.Connection, rid: str, seq: int, stored_events: int, after: Iterable[Claim]) -> int:
    """Sequence numbers up to ``seq`` that no stored or already reconciled event accounts for: the most
    missing events any snapshot can claim."""
    stored = stored_events - sum(a[2] for a in after)
    (reconciled_events,) = db.execute("SELECT coalesce(sum(reconciled_events), 0) FROM runtime_ledger "
                                      "WHERE runtime_id=?", (rid,)).fetchone()
    return int(seq - stored - reconciled_events)


def reconcile_counters(db: sqlite3.Connection, counters: Mapping[str, Any], now_ns: int, limits: ReconcileLimits,
                       mark_changed: Callable[[Iterable[int]], None]) -> list[Reconciliation]:
    """Inside a transaction: compare parsed counters with the store's ledger, book what may be booked and
    record every finding. An older snapshot than the last one (unless final) changes nothing."""
    rid, seq = counters["runtime_id"], counters["seq"]
    row = db.execute("SELECT counters_seq, events FROM runtimes WHERE runtime_id=?", (rid,)).fetchone()
    if row is not None and row[0] >= seq and not counters["final"]:
        return []
    after = _events_after(db, rid, seq)
    gaps = _gaps(db, rid, seq, row[1] if row else 0, after.values())
    minute = minute_of(counters["written_ns"] or now_ns)
    found: list[Reconciliation] = []
    for t in counters["totals"]:
        key = (t["tenant"], t["model"])
        lg = db.execute(_LEDGER, (rid, *key)).fetchone() or (0,) * 9
        a = after.get(key, (0, 0, 0))
        claim = (t["input_tokens"] - (lg[0] - a[0]) - lg[3], t["output_tokens"] - (lg[1] - a[1]) - lg[4],
                 t["events"] - (lg[2] - a[2]) - lg[5])
        if min(claim) < 0:
            found.append(Reconciliation(rid, *key, seq, *claim, "disagreement"))
            continue
        booked = bookable(limits, claim, gaps, metered=lg[0] + lg[1], reconciled=lg[3] + lg[4])
        gaps -= booked[2]
        held = (claim[0] - booked[0], claim[1] - booked[1], claim[2] - booked[2])
        found += _book(db, Reconciliation(rid, *key, seq, *booked, "reconciled"), held, tuple(lg[6:9]), minute,
                       mark_changed)
    db.executemany("INSERT INTO reconciliations VALUES (?,?,?,?,?,?,?,?,?)",
                   [(now_ns, r.runtime_id, r.tenant, r.model, r.counters_seq, r.input_tokens, r.output_tokens,
                     r.events, r.kind) for r in found])
    db.execute(_RECORD_RUNTIME, (rid, counters["pid"], seq, 1 if counters["final"] else 0))
    return found


def _book(db: sqlite3.Connection, booked: Reconciliation, held: Claim, held_before: tuple[Any, ...], minute: int,
          mark_changed: Callable[[Iterable[int]], None]) -> list[Reconciliation]:
    """Book one (tenant, model)'s bookable part into its minute, the totals and the ledger; record what is
    held when that changed. Returns the findings: ``held`` and/or ``reconciled``."""
    found = []
    amounts = (booked.input_tokens, booked.output_tokens, booked.events)
    key = (booked.tenant, booked.model)
    if held != held_before:
        found.append(dataclasses.replace(booked, input_tokens=held[0], output_tokens=held[1], events=held[2],
                                         kind="held"))
    if any(amounts):
        found.append(booked)
        db.execute(_BOOK_MINUTE, (minute, *key, *amounts[:2]))
        db.execute(_BOOK_TOTAL, (*key, *amounts[:2]))
        mark_changed((minute,))
    if found:
        db.execute(_BOOK_LEDGER, (booked.runtime_id, *key, *amounts, *held))
    return found
