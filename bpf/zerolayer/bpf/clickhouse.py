"""ClickHouse for fleets: each node's auditor mirrors its committed audit tables into one ClickHouse.

The same tables as the SQLite store (bpf/store.py), plus a ``node`` column. ClickHouse has no
multi-table transactions, so exactly-once stays where it is proven -- the node's SQLite store --
and the mirror sends *final values*, never increments: every row carries a ``version`` and the
tables are ``ReplacingMergeTree(version)``, so sending a minute again (after a crash, or because
reconciliation changed it) replaces it instead of adding to it. Queries read with ``FINAL``.
Which minutes to send: those the store marked changed since the last successful sync
(``minute_changes``), however old -- late events and reconciliations land in old minutes. Versions
only grow (never below the last one sent, even if the wall clock steps back).
Per-event detail stays on the node under its retention; ClickHouse holds the aggregates.

Client: ``clickhouse-connect`` (HTTP). Its errors become :class:`StoreError`.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlparse

from zerolayer.bpf.errors import StoreError
from zerolayer.bpf.store import NS, SqliteStore, UsageRow, aggregate_usage

DDL = (
    """CREATE TABLE IF NOT EXISTS usage_minute (
        node String, minute UInt32, tenant String, model String,
        input_tokens UInt64, output_tokens UInt64, requests UInt64, events UInt64,
        reconciled_input UInt64, reconciled_output UInt64, version UInt64)
    ENGINE = ReplacingMergeTree(version) ORDER BY (tenant, minute, model, node)""",
    """CREATE TABLE IF NOT EXISTS energy_minute (
        node String, minute UInt32, gpu String, joules Float64, version UInt64)
    ENGINE = ReplacingMergeTree(version) ORDER BY (minute, gpu, node)""",
    """CREATE TABLE IF NOT EXISTS runtimes (
        node String, runtime_id String, pid UInt32, hwm UInt64, events UInt64, pruned_seq UInt64,
        counters_seq UInt64, final UInt8, version UInt64)
    ENGINE = ReplacingMergeTree(version) ORDER BY (node, runtime_id)""",
    """CREATE TABLE IF NOT EXISTS reconciliations (
        node String, at_ns UInt64, runtime_id String, tenant String, model String, counters_seq UInt64,
        input_tokens Int64, output_tokens Int64, events Int64, kind String)
    ENGINE = ReplacingMergeTree ORDER BY (node, runtime_id, tenant, model, counters_seq, kind)""",
)
USAGE_COLUMNS = ["node", "minute", "tenant", "model", "input_tokens", "output_tokens", "requests", "events",
                 "reconciled_input", "reconciled_output", "version"]
ENERGY_COLUMNS = ["node", "minute", "gpu", "joules", "version"]
RUNTIME_COLUMNS = ["node", "runtime_id", "pid", "hwm", "events", "pruned_seq", "counters_seq", "final", "version"]
RECON_COLUMNS = ["node", "at_ns", "runtime_id", "tenant", "model", "counters_seq", "input_tokens", "output_tokens",
                 "events", "kind"]


def connect(url: str) -> Any:
    """A clickhouse-connect client for ``http(s)://[user:password@]host:port/database``."""
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise StoreError("ClickHouse needs clickhouse-connect (pip install clickhouse-connect)") from exc
    u = urlparse(url)
    try:
        return clickhouse_connect.get_client(
            host=u.hostname or "localhost", port=u.port or 8123, username=u.username or "default",
            password=u.password or "", database=u.path.strip("/") or "default", secure=u.scheme == "https")
    except Exception as exc:  # clickhouse-connect raises its own and urllib3's errors
        raise StoreError(f"cannot connect to ClickHouse at {u.hostname}:{u.port}: {exc}") from exc


class ClickHouseMirror:
    """Pushes a node's SQLite audit tables to ClickHouse; reads fleet-wide usage back."""

    kind = "clickhouse"

    def __init__(self, client: Any, node: str) -> None:
        self.client = client
        self.node = node
        try:
            for statement in DDL:
                client.command(statement)
        except Exception as exc:
            raise StoreError(f"cannot create the ClickHouse audit tables: {exc}") from exc

    def sync(self, store: SqliteStore, now_ns: int | None = None) -> int:
        """Send the minutes that changed since the last sync, new reconciliations and runtime state. Idempotent:
        the cursors move only after every insert succeeded, so a failed sync is re-sent whole."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        db = store.db
        changed_after = int(store.state("clickhouse_change", "0") or 0)
        recon_after = int(store.state("clickhouse_reconciliation", "0") or 0)
        version = max(now_ns, int(store.state("clickhouse_version", "0") or 0) + 1)
        (top,) = db.execute("SELECT coalesce(max(change), 0) FROM minute_changes").fetchone()
        dirty = "SELECT minute FROM minute_changes WHERE change > ?"
        usage = [[self.node, *row, version] for row in db.execute(
            "SELECT minute, tenant, model, input_tokens, output_tokens, requests, events, reconciled_input, "
            f"reconciled_output FROM usage_minute WHERE minute IN ({dirty})", (changed_after,))]
        energy = [[self.node, *row, version] for row in db.execute(
            f"SELECT minute, gpu, joules FROM energy_minute WHERE minute IN ({dirty})", (changed_after,))]
        runtimes = [[self.node, *row, version] for row in db.execute(
            "SELECT runtime_id, pid, hwm, events, pruned_seq, counters_seq, final FROM runtimes")]
        recon_rows = db.execute(
            "SELECT rowid, at_ns, runtime_id, tenant, model, counters_seq, input_tokens, output_tokens, events, kind "
            "FROM reconciliations WHERE rowid > ? ORDER BY rowid", (recon_after,)).fetchall()
        recon = [[self.node, *row[1:]] for row in recon_rows]
        try:
            for table, rows, columns in (("usage_minute", usage, USAGE_COLUMNS), ("energy_minute", energy,
                                         ENERGY_COLUMNS), ("runtimes", runtimes, RUNTIME_COLUMNS),
                                         ("reconciliations", recon, RECON_COLUMNS)):
                if rows:
                    self.client.insert(table, rows, column_names=columns)
        except Exception as exc:
            raise StoreError(f"ClickHouse insert failed: {exc}") from exc
        store.set_state({"clickhouse_change": str(top), "clickhouse_version": str(version),
                         "clickhouse_reconciliation": str(recon_rows[-1][0] if recon_rows else recon_after)})
        return len(usage)

    def usage(self, since_ns: int, until_ns: int | None = None, tenant: str | None = None) -> list[UsageRow]:
        """Fleet-wide usage per (tenant, model): the same figures as :meth:`SqliteStore.usage`, all nodes."""
        until = (until_ns if until_ns is not None else time.time_ns() + 60 * NS) // NS
        since = since_ns // NS // 60 * 60
        try:
            rows = self.client.query(
                "SELECT minute, tenant, model, sum(input_tokens), sum(output_tokens), sum(requests), sum(events), "
                "sum(reconciled_input), sum(reconciled_output) FROM usage_minute FINAL "
                "WHERE minute >= {since:UInt32} AND minute < {until:UInt32} GROUP BY minute, tenant, model",
                parameters={"since": since, "until": until}).result_rows
            energy = dict(self.client.query(
                "SELECT minute, sum(joules) FROM energy_minute FINAL WHERE minute >= {since:UInt32} "
                "AND minute < {until:UInt32} GROUP BY minute", parameters={"since": since, "until": until}
            ).result_rows)
        except Exception as exc:
            raise StoreError(f"ClickHouse query failed: {exc}") from exc
        return aggregate_usage([tuple(r) for r in rows], energy, tenant)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error worth raising
            pass


