"""The ClickHouse mirror's DDL and queries on a real ClickHouse engine: chdb, in-process.

chdb is ClickHouse's engine as a library, not a ClickHouse server: this checks our schema, the
ReplacingMergeTree/FINAL semantics that make re-sent minutes idempotent, and the fleet query. The
transport (clickhouse-connect over HTTP) is NOT exercised here: no ClickHouse server that
clickhouse-connect accepts can run on this machine (Debian's 18.16 server rejects its handshake).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from zerolayer.bpf.clickhouse import ClickHouseMirror
from zerolayer.bpf.events import FLAG_FIRST, TokenEvent
from zerolayer.bpf.store import NS, SqliteStore

chdb_session = pytest.importorskip("chdb.session", reason="chdb (in-process ClickHouse engine) is not installed")

T0 = 1_800_000_000 * NS


def literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


class ChdbClient:
    """Test double for the clickhouse-connect client: the same three calls, on the in-process engine."""

    def __init__(self, path: str) -> None:
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


def ev(seq: int, tenant: str, out: int, at_s: float = 0, rid: int = 1) -> TokenEvent:
    return TokenEvent(rid, seq, T0 + int(at_s * NS), tenant, "tiny", "r", 0, out, FLAG_FIRST if seq == 1 else 0)


def test_mirror_is_idempotent_and_sums_the_fleet(tmp_path):
    client = ChdbClient(str(tmp_path / "ch"))
    try:
        node_a, node_b = SqliteStore(tmp_path / "a.db"), SqliteStore(tmp_path / "b.db")
        node_a.write([ev(1, "acme", 5), ev(2, "acme", 5), ev(3, "globex", 2, at_s=60)])
        node_b.write([ev(1, "acme", 7, rid=9)])
        mirror_a, mirror_b = ClickHouseMirror(client, "node-a"), ClickHouseMirror(client, "node-b")
        mirror_a.sync(node_a, now_ns=T0 + 120 * NS)
        mirror_b.sync(node_b, now_ns=T0 + 120 * NS)
        # more events and a reconciliation change a minute already sent: re-sending replaces, never adds
        node_a.write([ev(4, "acme", 1)])
        node_a.reconcile({"runtime_id": f"{1:016x}", "pid": 1, "seq": 5, "written_ns": T0, "totals": [
            {"tenant": "acme", "model": "tiny", "input_tokens": 0, "output_tokens": 14, "events": 4}]})
        mirror_a.sync(node_a, now_ns=T0 + 180 * NS)
        mirror_a.sync(node_a, now_ns=T0 + 181 * NS)
        fleet = {r.tenant: r for r in mirror_a.usage(T0, T0 + 3600 * NS)}
        assert (fleet["acme"].output_tokens, fleet["acme"].reconciled_output, fleet["acme"].requests) == (18, 3, 2)
        assert fleet["globex"].output_tokens == 2
        local = {r.tenant: r for r in node_a.usage(T0, T0 + 3600 * NS)}
        assert local["acme"].output_tokens + 7 == fleet["acme"].output_tokens
    finally:
        client.close()
