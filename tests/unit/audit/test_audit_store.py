"""Aggregation and exactly-once in the SQLite audit store, reconciliation with runtime counters."""

from __future__ import annotations

import sqlite3

import pytest

from zerolayer.bpf.errors import StoreError
from zerolayer.bpf.events import FLAG_FIRST, TokenEvent
from zerolayer.bpf.store import NS, SqliteStore, WriteResult

T0 = 1_800_000_000 * NS  # a minute boundary (1800000000 is divisible by 60)


def ev(seq: int, tenant: str = "acme", out: int = 1, inp: int = 0, at_s: float = 0.0, rid: int = 0xA,
       model: str = "tiny", first: bool = False) -> TokenEvent:
    return TokenEvent(rid, seq, T0 + int(at_s * NS), tenant, model, f"req-{tenant}", inp, out,
                      FLAG_FIRST if first else 0, 42, 1, "bpf")


def counters(seq: int, rows: list[tuple[str, str, int, int, int]], rid: int = 0xA, final: bool = False) -> dict:
    return {"runtime_id": f"{rid:016x}", "pid": 42, "seq": seq, "written_ns": T0, "final": final,
            "totals": [{"tenant": t, "model": m, "input_tokens": i, "output_tokens": o, "events": n, "requests": 0}
                       for t, m, i, o, n in rows]}


def test_aggregates_per_tenant_model_and_minute(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    store.write([ev(1, inp=10, out=0, first=True), ev(2), ev(3), ev(4, at_s=61), ev(5, tenant="globex", out=3)])
    rows = {(r[0], r[1]): r[2:] for r in store.db.execute(
        "SELECT minute, tenant, input_tokens, output_tokens, requests, events FROM usage_minute")}
    m0 = T0 // NS
    assert rows[(m0, "acme")] == (10, 2, 1, 3)
    assert rows[(m0 + 60, "acme")] == (0, 1, 0, 1)
    assert rows[(m0, "globex")] == (0, 3, 0, 1)
    usage = {r.tenant: r for r in store.usage(T0, T0 + 3600 * NS)}
    assert (usage["acme"].input_tokens, usage["acme"].output_tokens, usage["acme"].requests) == (10, 3, 1)
    assert [r.tenant for r in store.usage(T0, T0 + 3600 * NS, tenant="globex")] == ["globex"]


def test_replayed_events_are_counted_once_across_a_restart(tmp_path):
    path = tmp_path / "a.db"
    store = SqliteStore(path)
    first = store.write([ev(s) for s in range(1, 6)])
    assert (first.written, first.duplicates) == (5, 0)
    store.close()
    store = SqliteStore(path)  # the auditor restarted; its source replays an overlapping range
    again = store.write([ev(s) for s in range(3, 9)])
    assert (again.written, again.duplicates) == (3, 3)
    assert store.db.execute("SELECT sum(output_tokens), sum(events) FROM usage_minute").fetchone() == (8, 8)
    assert store.db.execute("SELECT hwm, events FROM runtimes").fetchone() == (8, 8)


def test_the_same_event_twice_in_one_batch_counts_once(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    assert store.write([ev(1), ev(2), ev(1), ev(2), ev(3)]) == WriteResult(3, 2)
    assert store.write([ev(2), ev(4), ev(4)]) == WriteResult(1, 2)
    assert store.db.execute("SELECT sum(output_tokens) FROM usage_minute").fetchone() == (4,)


def test_state_is_committed_with_the_events_or_not_at_all(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    store.write([ev(1)], {"journal:x": "100"})
    bad = ev(2, tenant=None)  # type: ignore[arg-type]  # NOT NULL violation inside the transaction
    with pytest.raises(StoreError, match="NOT NULL"):
        store.write([ev(3), bad], {"journal:x": "300"})
    assert store.state("journal:x") == "100"
    assert store.db.execute("SELECT count(*) FROM token_events").fetchone() == (1,)
    assert store.db.execute("SELECT sum(events) FROM usage_minute").fetchone() == (1,)


def test_pruned_detail_still_rejects_replays(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    store.write([ev(1), ev(2), ev(3, at_s=3600)])
    assert store.prune(T0 + 60 * NS) == 2
    replay = store.write([ev(1), ev(2), ev(4, at_s=3601)])
    assert (replay.written, replay.duplicates) == (1, 2)
    assert store.db.execute("SELECT sum(output_tokens) FROM usage_minute").fetchone() == (4,)


def test_gaps_are_missing_events_and_counters_reconcile_them(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    # events 1..10, 1 output token each; 4..6 never arrive (auditor down), 9..10 arrive after the snapshot
    store.write([ev(s) for s in (1, 2, 3, 7, 8, 9, 10)])
    assert store.totals()["runtimes"][0]["missing"] == 3
    found = store.reconcile(counters(8, [("acme", "tiny", 0, 8, 8)]))
    assert [(r.kind, r.output_tokens, r.events) for r in found] == [("reconciled", 3, 3)]
    billed = store.usage(T0, T0 + 3600 * NS)[0]
    assert billed.output_tokens + billed.reconciled_output == 10
    # the same or an older snapshot changes nothing; a newer one adds only what is new
    assert store.reconcile(counters(8, [("acme", "tiny", 0, 8, 8)])) == []
    assert store.reconcile(counters(10, [("acme", "tiny", 0, 10, 10)])) == []
    store.write([ev(11), ev(13)])
    found = store.reconcile(counters(13, [("acme", "tiny", 0, 13, 13)], final=True))
    assert [(r.output_tokens, r.events) for r in found] == [(1, 1)]
    billed = store.usage(T0, T0 + 3600 * NS)[0]
    assert billed.output_tokens + billed.reconciled_output == 13


def test_store_above_counters_is_a_disagreement_and_books_nothing(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    store.write([ev(1, out=5), ev(2, out=5)])
    found = store.reconcile(counters(2, [("acme", "tiny", 0, 7, 2)]))
    assert [(r.kind, r.output_tokens) for r in found] == [("disagreement", -3)]
    assert store.db.execute("SELECT sum(reconciled_output) FROM usage_minute").fetchone() == (0,)
    assert store.totals()["reconciliations"][0]["kind"] == "disagreement"


def test_energy_is_shared_by_tokens_per_minute(tmp_path):
    store = SqliteStore(tmp_path / "a.db")
    store.write([ev(1, out=30), ev(2, out=10, tenant="globex"), ev(3, out=5, at_s=60)])
    store.add_energy(T0 // NS, "gpu-0", 4000.0)
    store.add_energy(T0 // NS + 60, "gpu-0", 100.0)
    usage = {r.tenant: r.energy_joules for r in store.usage(T0, T0 + 3600 * NS)}
    assert usage == {"acme": 3000.0 + 100.0, "globex": 1000.0}


def test_wal_mode(tmp_path):
    SqliteStore(tmp_path / "a.db").close()
    assert sqlite3.connect(tmp_path / "a.db").execute("PRAGMA journal_mode").fetchone() == ("wal",)
