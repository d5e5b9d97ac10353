"""Metering with API processes side by side (issue 29): two runtime processes on one port, each with
its own token probe in the same spool, one auditor. Billed output tokens per tenant == tokens the
clients received, every event once, both processes metered; the auditor is killed and restarted
while both serve (bpf: the missed events come back from each process's counters; journal: kept).
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from audit_helpers import (  # noqa: E402
    Ledger,
    Processes,
    auditor_starter,
    bpf_skip_reason,
    free_port,
    load,
    wait_for_port,
    write_config,
)

from zerolayer.bpf.store import SqliteStore  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.parametrize("source", ["journal", "bpf"])
async def test_two_api_processes_are_billed_what_their_clients_received(tmp_path, source):
    if source == "bpf" and (reason := bpf_skip_reason()):
        pytest.skip(reason)
    spool, db, config = tmp_path / "spool", tmp_path / "audit.db", tmp_path / "runtime.json"
    model = write_config(config)
    port = free_port()
    procs = Processes(tmp_path)
    runtime_args = ["runtime", "--config", str(config), "--port", str(port), "--audit-spool", str(spool),
                    "--api-processes", "2"]
    if source == "journal":
        runtime_args.append("--audit-journal")
    start_auditor = auditor_starter(procs, source, spool, db)
    try:
        runtime = procs.start("runtime", *runtime_args)
        await asyncio.to_thread(wait_for_port, port, 120)
        auditor = await asyncio.to_thread(start_auditor)  # after the processes wrote their first counters
        ledger = Ledger()
        stop = asyncio.Event()
        clients = asyncio.create_task(load(lambda: port, ledger, stop, workers_per_tenant=4, model=model))
        await asyncio.sleep(2.0)
        procs.kill(auditor)  # both processes keep serving while no auditor reads
        await asyncio.sleep(1.0)
        auditor = await asyncio.to_thread(start_auditor)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(clients, 60)
        assert procs.kill(runtime, signal.SIGTERM) == 0  # clean stop: every process fires and writes final counters
        await asyncio.sleep(1.5)  # one reconcile interval
        assert procs.kill(auditor, signal.SIGTERM) == 0
    finally:
        procs.close()

    assert ledger.completed > 20 and ledger.broken == 0 and ledger.usage_mismatch == 0
    store = SqliteStore(db)
    totals = store.totals()
    billed = {t: o for t, o in store.db.execute(
        "SELECT tenant, sum(output_tokens + reconciled_output) FROM usage_minute GROUP BY tenant")}
    print(f"\n{source}: received {ledger.received}, billed {billed}")
    for r in totals["runtimes"]:
        print(f"  runtime {r['runtime_id']}: events {r['events']} missing {r['missing']} final {r['final']}")
    runtimes = totals["runtimes"]
    assert len(runtimes) == 2 and all(r["final"] for r in runtimes)  # one probe per API process, both stopped clean
    assert all(r["events"] > 0 for r in runtimes), "both processes served and were metered"
    assert store.db.execute("SELECT count(*), count(DISTINCT runtime_id || ':' || seq) FROM token_events"
                            ).fetchone()[0] == sum(r["events"] for r in runtimes)
    assert [r for r in totals["reconciliations"] if r["kind"] == "disagreement"] == []
    assert sum(r["missing"] for r in runtimes) == sum(r["reconciled_events"] for r in totals["ledger"])
    if source == "journal":
        assert sum(r["missing"] for r in runtimes) == 0
    assert billed == ledger.received
