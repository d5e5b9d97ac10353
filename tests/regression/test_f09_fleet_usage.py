"""Review finding 9 (a, b, c, e): fleet billing and usage figures.

- (a) every node's auditor wrote its own node's totals into the same ``TenantQuota.status.usage``:
  the last writer won. Now each node keeps its entry under ``usage.nodes.<node>`` and the top-level
  fields are the fleet sum, written with a resourceVersion precondition;
- (b) TenantQuotas created after the auditor started were never published, and prices were read
  once at start;
- (c) the ClickHouse mirror re-sent only the last 10 minutes: late events and old reconciliations
  never reached it. It now re-sends the minutes that changed;
- (e) every status cycle rescanned every aggregate since the epoch (``store.usage(0)``); totals are
  now kept running.
"""

from __future__ import annotations

import copy
import json
import re
import time
from decimal import Decimal
from typing import Any

import pytest

from zerolayer.bpf.auditor import Auditor
from zerolayer.bpf import errors
from zerolayer.bpf.events import TokenEvent
from zerolayer.bpf.journal import JournalSource
from zerolayer.bpf.kube import QuotaStatusWriter
from zerolayer.bpf.store import NS, SqliteStore, minute_of

pytestmark = [pytest.mark.regression, pytest.mark.timeout(120)]
NOW = time.time_ns()


def ev(seq: int, tenant: str = "acme", out: int = 10, inp: int = 0, at_ns: int | None = None,
       rid: int = 0xA) -> TokenEvent:
    return TokenEvent(rid, seq, NOW if at_ns is None else at_ns, tenant, "tiny", "r", inp, out,
                      1 if seq == 1 else 0, 42, 1, "journal")


def early_in_a_minute() -> int:
    """Now, at least 5 s before the minute ends (window figures are per current minute)."""
    while time.time_ns() // NS % 60 > 54:
        time.sleep(0.5)
    return time.time_ns()


def merge(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch, as the API server applies it."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


class Conflict(getattr(errors, "QuotaStatusConflict", errors.QuotaStatusError)):  # type: ignore[misc]
    """What TenantQuotaApi raises on a 409 (QuotaStatusConflict; before the fix there was none)."""


class FakeTenantQuotaApi:
    """The API server's side of ``bpf/kube.TenantQuotaApi`` for TenantQuotas: merge patches on status,
    resourceVersion preconditions, lists and gets. Shared by several nodes' auditors."""

    def __init__(self, quotas: list[dict[str, Any]]) -> None:
        self.objects = {q["metadata"]["name"]: merge({"metadata": {"resourceVersion": "1"}}, q) for q in quotas}
        self.version = 1
        self.patches = 0

    def add(self, quota: dict[str, Any]) -> None:
        self.version += 1
        self.objects[quota["metadata"]["name"]] = merge({"metadata": {"resourceVersion": str(self.version)}}, quota)

    def list(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.objects.values()))

    def get(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.objects[name])

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[name]
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise Conflict(f"409 Conflict on {name}")
        self.version += 1
        merge(obj, {"status": patch.get("status") or {}})
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.patches += 1
        return copy.deepcopy(obj)

    def patch_usage(self, name: str, usage: dict[str, Any]) -> None:  # what the auditor called before
        self.patch_status(name, {"status": {"usage": usage}})

    def usage(self, name: str) -> dict[str, Any]:
        return self.objects[name].get("status", {}).get("usage", {})


def quota(tenant: str, input_price: str = "0", output_price: str = "0") -> dict[str, Any]:
    return {"metadata": {"name": f"{tenant}-quota"},
            "spec": {"tenant": tenant, "prices": {"currency": "USD", "inputPer1kTokens": input_price,
                                                  "outputPer1kTokens": output_price}}}


def node_auditor(tmp_path, name: str, api: FakeTenantQuotaApi) -> Auditor:
    spool = tmp_path / f"{name}-spool"
    writer = QuotaStatusWriter(api, min_interval_s=0, node=name) if _writer_takes_node() else \
        QuotaStatusWriter(api, min_interval_s=0)
    return Auditor(SqliteStore(tmp_path / f"{name}.db"), JournalSource(spool), spool=spool, quota_writer=writer)


def _writer_takes_node() -> bool:
    import inspect

    return "node" in inspect.signature(QuotaStatusWriter).parameters


# ---------------------------------------------------------------------------------------------- (a)
def test_a_two_nodes_usage_is_summed_not_overwritten(tmp_path):
    api = FakeTenantQuotaApi([quota("acme", output_price="1")])
    a, b = node_auditor(tmp_path, "node-a", api), node_auditor(tmp_path, "node-b", api)
    now = early_in_a_minute()
    a.store.write([ev(1, out=100, inp=7, at_ns=now), ev(2, out=50, at_ns=now)])
    b.store.write([ev(1, out=30, inp=3, rid=0xB, at_ns=now)])
    for _ in range(2):  # and again: nothing is counted twice
        a.publish_status()
        b.publish_status()
        a.publish_status()
    usage = api.usage("acme-quota")
    assert (usage["inputTokensTotal"], usage["outputTokensTotal"]) == (10, 180)
    assert usage["tokensThisWindow"] == 190 and usage["requestsThisWindow"] == 2
    assert Decimal(usage["cost"]) == Decimal("0.18")
    assert usage["nodes"]["node-a"]["outputTokensTotal"] == 150
    assert usage["nodes"]["node-b"]["outputTokensTotal"] == 30


def test_a_a_concurrent_write_between_read_and_patch_is_not_lost(tmp_path):
    api = FakeTenantQuotaApi([quota("acme")])
    a, b = node_auditor(tmp_path, "node-a", api), node_auditor(tmp_path, "node-b", api)
    a.store.write([ev(1, out=100)])
    b.store.write([ev(1, out=30, rid=0xB)])
    real_list = api.list

    def list_then_b_writes() -> list[dict[str, Any]]:
        items = real_list()
        if api.list is not real_list:  # node b publishes between node a's read and node a's patch
            api.list = real_list
            b.publish_status()
        return items

    a.publish_status()
    api.list = list_then_b_writes
    a.store.write([ev(2, out=1)])
    a.publish_status()
    assert api.usage("acme-quota")["outputTokensTotal"] == 131


# ---------------------------------------------------------------------------------------------- (b)
def test_b_tenants_created_later_are_published(tmp_path):
    api = FakeTenantQuotaApi([quota("acme")])
    auditor = node_auditor(tmp_path, "node-a", api)
    auditor.store.write([ev(1)])
    auditor.publish_status()
    api.add(quota("globex"))  # created after the auditor started
    auditor.store.write([ev(2, tenant="globex", out=4)])
    auditor.publish_status()
    assert api.usage("globex-quota")["outputTokensTotal"] == 4


def test_b_prices_are_reread_every_cycle(tmp_path):
    api = FakeTenantQuotaApi([quota("acme", output_price="1")])
    auditor = node_auditor(tmp_path, "node-a", api)
    auditor.store.write([ev(1, out=1000)])
    auditor.publish_status()
    assert Decimal(api.usage("acme-quota")["cost"]) == Decimal("1")
    api.objects["acme-quota"]["spec"]["prices"]["outputPer1kTokens"] = "3"
    auditor.store.write([ev(2, out=1000)])
    auditor.publish_status()
    assert Decimal(api.usage("acme-quota")["cost"]) == Decimal("6")


# ---------------------------------------------------------------------------------------------- (c)
def literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


class ChdbClient:
    """clickhouse-connect's three calls on the in-process engine (as in tests/unit/audit)."""

    def __init__(self, path: str) -> None:
        chdb_session = pytest.importorskip("chdb.session", reason="chdb (in-process ClickHouse engine) is not installed")
        self.session = chdb_session.Session(path)

    def command(self, sql: str) -> None:
        self.session.query(sql)

    def insert(self, table: str, rows: list[list[Any]], column_names: list[str]) -> None:
        values = ", ".join("(" + ", ".join(literal(v) for v in row) + ")" for row in rows)
        self.session.query(f"INSERT INTO {table} ({', '.join(column_names)}) VALUES {values}")

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        sql = re.sub(r"\{(\w+):\w+\}", lambda m: literal((parameters or {})[m.group(1)]), sql)
        out = str(self.session.query(sql + " SETTINGS output_format_json_quote_64bit_integers = 0", "JSONCompact"))

        class Result:
            result_rows = json.loads(out)["data"] if out.strip() else []

        return Result()

    def close(self) -> None:
        self.session.close()


def test_c_late_events_and_old_reconciliations_reach_clickhouse(tmp_path):
    from zerolayer.bpf.clickhouse import ClickHouseMirror

    client = ClickHouseMirror(ChdbClient(str(tmp_path / "ch")), "node-a")
    try:
        store = SqliteStore(tmp_path / "a.db")
        t0 = minute_of(NOW) * NS - 3600 * NS
        store.write([ev(1, out=5, at_ns=t0), ev(2, out=5, at_ns=t0)])
        client.sync(store, now_ns=t0 + 60 * NS)
        client.sync(store, now_ns=t0 + 20 * 60 * NS)
        # Events replayed 20 minutes late (an auditor outage: the journal keeps their original time).
        store.write([ev(3, out=7, at_ns=t0), ev(5, out=1, at_ns=t0 + 60 * NS)])
        # A snapshot written back then reconciles the missing event 4 into that old minute.
        store.reconcile({"runtime_id": f"{0xA:016x}", "pid": 42, "seq": 5, "written_ns": t0 + 60 * NS,
                         "totals": [{"tenant": "acme", "model": "tiny", "input_tokens": 0, "output_tokens": 20,
                                     "events": 5}]})
        client.sync(store, now_ns=t0 + 21 * 60 * NS)
        fleet = {(r.tenant, r.output_tokens, r.reconciled_output) for r in client.usage(t0, t0 + 3600 * NS)}
        local = {(r.tenant, r.output_tokens, r.reconciled_output) for r in store.usage(t0, t0 + 3600 * NS)}
        assert local == {("acme", 18, 2)}
        assert fleet == local
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------- (e)
def _steps(store: SqliteStore, work) -> int:  # type: ignore[no-untyped-def]
    """SQLite virtual-machine instructions (in thousands) that ``work`` runs: cost independent of timing."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    store.db.set_progress_handler(tick, 1000)
    try:
        work()
    finally:
        store.db.set_progress_handler(None, 0)
    return steps[0]


def _status_cost(tmp_path, name: str, minutes: int) -> int:
    api = FakeTenantQuotaApi([quota("acme")])
    auditor = node_auditor(tmp_path, name, api)
    start = minute_of(NOW) * NS - minutes * 60 * NS
    auditor.store.write([ev(s + 1, at_ns=start + s * 60 * NS) for s in range(minutes)])
    auditor.publish_status()  # the first cycle may read the history once
    auditor.store.write([ev(minutes + 1)])
    return _steps(auditor.store, auditor.publish_status)


def test_e_a_status_cycle_does_not_rescan_the_history(tmp_path):
    short, long = _status_cost(tmp_path, "short", 200), _status_cost(tmp_path, "long", 20_000)
    assert long <= 2 * short + 20, f"a status cycle costs {short} with 200 minutes of history, {long} with 20000"
