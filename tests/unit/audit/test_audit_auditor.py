"""The auditor loop on the journal path: exactly once over restarts, reconciliation, status writes."""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

from zerolayer.bpf.auditor import Auditor, AuditorSettings
from zerolayer.bpf.journal import JournalSource
from zerolayer.bpf.kube import QuotaStatusWriter
from zerolayer.bpf.probes import TokenProbe
from zerolayer.bpf.store import SqliteStore


def resume_state(store: SqliteStore) -> dict[str, str]:
    return dict(store.db.execute("SELECT key, value FROM auditor_state WHERE key LIKE 'journal:%'").fetchall())


def billed(store: SqliteStore) -> dict[str, int]:
    return {t: o for t, o in store.db.execute(
        "SELECT tenant, sum(output_tokens + reconciled_output) FROM usage_minute GROUP BY tenant")}


def test_restarts_neither_drop_nor_double_count(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "audit.db"
    probe = TokenProbe(spool, journal=True)
    sent = {"acme": 0, "globex": 0}
    for round_ in range(3):
        for i in range(50):
            tenant = "acme" if i % 3 else "globex"
            probe.emit(tenant, f"r{round_}", "tiny", 0, 2)
            sent[tenant] += 2
        store = SqliteStore(db)
        auditor = Auditor(store, JournalSource(spool, resume_state(store)), spool=spool)
        auditor.drain()
        if round_ == 1:
            auditor.source.offsets.clear()  # a crash that lost the source position: replays from the start
            auditor.source._pending.clear()
            auditor.drain()
        store.close()  # "killed": the next round is a fresh auditor
    store = SqliteStore(db)
    assert billed(store) == sent
    assert store.db.execute("SELECT hwm, events FROM runtimes").fetchone() == (150, 150)
    probe.close()


def test_run_loop_stops_cleanly_and_reconciles(tmp_path):
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=False)  # counters only: every event must come from reconciliation
    for _ in range(7):
        probe.emit("acme", "r", "tiny", 0, 1)
    probe.close()
    store = SqliteStore(tmp_path / "audit.db")
    spool.joinpath("empty.journal").write_bytes(b"")
    auditor = Auditor(store, JournalSource(spool), spool=spool,
                      settings=AuditorSettings(flush_interval_s=0.01, reconcile_interval_s=0.01))
    thread = threading.Thread(target=auditor.run)
    thread.start()
    auditor.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert billed(store) == {"acme": 7}
    assert store.totals()["reconciliations"][0]["kind"] == "reconciled"
    assert store.state("mode") == "journal"


class RecordingTenantQuotaApi:
    """Test double at our own wrapper's level (bpf/kube.TenantQuotaApi), not the HTTP client."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def list(self) -> list[dict[str, Any]]:
        return [{"metadata": {"name": "acme-quota"}, "spec": {"tenant": "acme"}}]

    def get(self, name: str) -> dict[str, Any]:
        return self.list()[0]

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches.append((name, patch["status"]["usage"]))
        return {}


def test_quota_status_writes_are_bounded_and_change_driven():
    now = [1000.0]
    api = RecordingTenantQuotaApi()
    writer = QuotaStatusWriter(api, min_interval_s=15, clock=lambda: now[0])
    writer.refresh()
    usage = {"acme": {"tokensThisWindow": 5}, "unknown": {"tokensThisWindow": 1}}
    assert writer.publish(usage) == 1
    now[0] += 5
    assert writer.publish({"acme": {"tokensThisWindow": 9}}) == 0  # too soon
    now[0] += 15
    assert writer.publish({"acme": {"tokensThisWindow": 9}}) == 1
    now[0] += 15
    assert writer.publish({"acme": {"tokensThisWindow": 9}}) == 0  # unchanged
    assert [p[0] for p in api.patches] == ["acme-quota", "acme-quota"]
    assert "lastUpdate" in api.patches[0][1]


def test_auditor_publishes_crd_usage_fields(tmp_path):
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=True)
    probe.emit("acme", "r", "tiny", 12, 0, first=True)
    probe.emit("acme", "r", "tiny", 0, 30)
    store = SqliteStore(tmp_path / "audit.db")
    api = RecordingTenantQuotaApi()
    auditor = Auditor(store, JournalSource(spool), spool=spool, quota_writer=QuotaStatusWriter(api))
    auditor.drain()
    auditor.publish_status()
    ((name, usage),) = api.patches
    assert name == "acme-quota"
    fields = {"windowStart", "tokensThisWindow", "requestsThisWindow", "inputTokensTotal", "outputTokensTotal",
              "cost", "lastUpdate"}
    assert set(usage) == fields | {"nodes"}  # the fleet sum, and this node's own entry
    assert set(usage["nodes"]["local"]) == fields
    assert (usage["inputTokensTotal"], usage["outputTokensTotal"], usage["requestsThisWindow"]) == (12, 30, 1)
    probe.close()


def test_energy_from_gpu_power_is_billed(tmp_path):
    from zerolayer.bpf.billing import PriceBook, Prices, bill
    from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

    gpus = SimulatedGpuSource({"gpus": [{"steps": [{"memory": 0.5, "samples": 10, "power_watts": 300}]},
                                        {"steps": [{"memory": 0.5, "samples": 10, "power_watts": 100}]}]})
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=True)
    probe.emit("acme", "r", "tiny", 0, 30)
    probe.emit("globex", "r", "tiny", 0, 10)
    now = [100.0]
    store = SqliteStore(tmp_path / "audit.db")
    auditor = Auditor(store, JournalSource(spool), spool=spool, energy_source=gpus, clock=lambda: now[0])
    auditor.drain()
    auditor.sample_energy()
    now[0] += 9.0  # 9 s at 400 W = 3600 J = 1 Wh
    auditor.sample_energy()
    usage = {r.tenant: r for r in store.usage(0)}
    assert (usage["acme"].energy_joules, usage["globex"].energy_joules) == (2700.0, 900.0)
    book = PriceBook({"acme": Prices()}, energy_per_kwh=Decimal("1000"))
    assert {b.tenant: b.energy_cost for b in bill(store.usage(0), book)} == {"acme": Decimal("0.75"),
                                                                              "globex": Decimal("0.25")}
    probe.close()


def test_auto_mode_falls_back_to_the_journal_and_says_so(tmp_path, monkeypatch, caplog):
    from zerolayer.bpf import auditor as auditor_module
    from zerolayer.bpf import loader
    from zerolayer.bpf.errors import BpfUnavailable

    def unavailable(**kwargs: Any) -> None:
        raise BpfUnavailable("not root: loading BPF programs needs root")

    monkeypatch.setattr(loader, "BpfTokenSource", unavailable)  # as on a host without BPF
    store = SqliteStore(tmp_path / "audit.db")
    with caplog.at_level("WARNING"):
        source = auditor_module.open_source("auto", spool=str(tmp_path / "spool"), store=store,
                                            ring_buffer_bytes=1 << 20)
    assert source.kind == "journal"
    assert "BPF unavailable (not root" in caplog.text
    auditor = Auditor(store, source, spool=tmp_path / "spool")
    assert auditor.metrics.mode.labels("journal")._value.get() == 1
    assert store.state("mode") == "journal"
