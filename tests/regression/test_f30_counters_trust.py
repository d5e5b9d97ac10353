"""Review finding 30: the auditor (root) trusted ``*.counters.json`` written by the server container.

- A document missing ``runtime_id`` (or not a JSON object at all) raised in the auditor's loop, so
  it crash-looped with metering stopped. It is now skipped, logged and counted.
- Reconciliation booked whatever the counters claimed: a compromised server could bill any
  tenant any amount as "reconciled" tokens. Booking is now capped: never more missing events than
  the runtime's sequence gaps, never more tokens than the allowance (a share of what was metered
  from events, at least a floor); the rest is *held*: recorded, counted, not billed.
"""

from __future__ import annotations

import json

import pytest

from zerolayer.bpf.auditor import Auditor
from zerolayer.bpf.events import TokenEvent
from zerolayer.bpf.journal import JournalSource
from zerolayer.bpf.store import NS, SqliteStore

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]
T0 = 1_800_000_000 * NS
RID = 0xA


def ev(seq: int, out: int = 10) -> TokenEvent:
    return TokenEvent(RID, seq, T0, "acme", "tiny", "r", 0, out, 0, 42, 1, "journal")


def counters(seq: int, out: int, events: int, tenant: str = "acme") -> dict:
    return {"runtime_id": f"{RID:016x}", "pid": 42, "seq": seq, "written_ns": T0, "final": False,
            "totals": [{"tenant": tenant, "model": "tiny", "input_tokens": 0, "output_tokens": out, "events": events,
                        "requests": 0}]}


def billed(store: SqliteStore) -> int:
    return store.db.execute("SELECT coalesce(sum(output_tokens + reconciled_output), 0) FROM usage_minute").fetchone()[0]


def test_malformed_counters_documents_are_skipped_not_fatal(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    store = SqliteStore(tmp_path / "audit.db")
    store.write([ev(1), ev(2)])
    (spool / "a.counters.json").write_text(json.dumps({"pid": 1, "seq": 3, "totals": []}))  # no runtime_id
    (spool / "b.counters.json").write_text(json.dumps([1, 2, 3]))  # not an object
    (spool / "c.counters.json").write_text(json.dumps({"runtime_id": "ff", "seq": "x", "totals": []}))
    (spool / "d.counters.json").write_text(json.dumps({"runtime_id": "ee", "seq": 1, "totals": [{"tenant": "x"}]}))
    (spool / "e.counters.json").write_text(json.dumps(counters(3, 30, 3)))  # the one good document
    auditor = Auditor(store, JournalSource(spool), spool=spool)
    found = auditor.reconcile()
    assert [(r.kind, r.output_tokens, r.events) for r in found] == [("reconciled", 10, 1)]
    assert auditor.metrics.registry.get_sample_value("zerolayer_auditor_bad_counters_total") == 4
    auditor.reconcile()  # and again: still no crash, nothing booked twice
    assert billed(store) == 30


def test_inflated_counters_are_capped_and_held_not_billed(tmp_path):
    store = SqliteStore(tmp_path / "audit.db")
    store.write([ev(s) for s in range(1, 11)])  # 100 tokens metered from events, seq 1..10
    # A compromised server claims one missing event carrying ten million tokens.
    found = store.reconcile(counters(11, 10_000_100, 11))
    assert billed(store) <= 100 + 100_000, "reconciliation booked what the counters claimed, uncapped"
    assert "held" in [r.kind for r in found]
    held = [r for r in store.totals()["reconciliations"] if r["kind"] == "held"]
    assert sum(r["output_tokens"] for r in held) == 10_000_000 - (billed(store) - 100)
    # It claims more missing events than there are sequence gaps: none of them is booked.
    found = store.reconcile(counters(12, 10_000_100 + 5, 16))
    assert billed(store) <= 100 + 100_000
    assert store.reconcile(counters(12, 10_000_100 + 5, 16)) == []  # the same snapshot: nothing new to record
