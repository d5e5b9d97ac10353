"""``zerolayer audit report`` outputs and the BPF program rendering (no root needed)."""

from __future__ import annotations

import csv
import io
import json
import signal
import time

import pytest

from zerolayer.bpf.cli import parse_duration
from zerolayer.bpf.events import FLAG_FIRST, TokenEvent
from zerolayer.bpf.loader import render_program, ring_pages
from zerolayer.bpf.store import SqliteStore
from zerolayer.cli import main


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "audit.db"
    store = SqliteStore(path)
    now = time.time_ns()
    store.write([TokenEvent(1, 1, now, "acme", "tiny", "r1", 100, 0, FLAG_FIRST),
                 TokenEvent(1, 2, now, "acme", "tiny", "r1", 0, 2000),
                 TokenEvent(1, 3, now, "globex", "tiny", "r2", 0, 7)])
    store.close()
    (tmp_path / "prices.yaml").write_text('tenants:\n  acme: {inputPer1kTokens: "1", outputPer1kTokens: "2"}\n')
    return path


def test_report_json_csv_table(db, capsys):
    prices = str(db.parent / "prices.yaml")
    assert main(["audit", "report", "--db", str(db), "--tenant", "acme", "--since", "1h", "--output", "json",
                 "--prices", prices]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["input_tokens"], row["output_tokens"], row["requests"], row["total"]) == (100, 2000, 1, "4.100000")
    assert main(["audit", "report", "--db", str(db), "--output", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["tenant"], r["output_tokens"]) for r in rows] == [("acme", "2000"), ("globex", "7")]
    assert main(["audit", "report", "--db", str(db), "--since", "1h"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("TENANT") and "globex" in out


def test_durations():
    assert parse_duration("90s") == 90 and parse_duration("1h") == 3600 and parse_duration("7d") == 7 * 86400
    with pytest.raises(Exception, match="unit"):
        parse_duration("1 hour")


def test_program_rendering():
    assert ring_pages(16 << 20) == 4096 and ring_pages(5000) == 2 and ring_pages(1) == 1
    text = render_program(ring_buffer_bytes=1 << 20, filter_pids=True)
    assert "BPF_RINGBUF_OUTPUT(events, 256)" in text
    assert "if (1 && !target_pids" in text and "if (0 && !in_target_cgroup(cgroup_id))" in text
    assert "RINGBUF_PAGES" not in text and "FILTER_" not in text


def test_print_bpf(capsys):
    assert main(["auditor", "--print-bpf", "--ring-buffer-mb", "1"]) == 0
    assert "bpf_get_current_cgroup_id()" in capsys.readouterr().out


def test_reconcile_and_status_commands(tmp_path, capsys):
    from zerolayer.bpf.probes import TokenProbe

    spool, db = tmp_path / "spool", tmp_path / "audit.db"
    probe = TokenProbe(spool)  # counters only: the store has none of its events
    probe.emit("acme", "r", "tiny", 5, 0, first=True)
    probe.emit("acme", "r", "tiny", 0, 9)
    probe.close()
    SqliteStore(db).close()
    assert main(["audit", "reconcile", "--db", str(db), "--spool", str(spool)]) == 0
    assert "reconciled: runtime" in capsys.readouterr().out
    assert main(["audit", "reconcile", "--db", str(db), "--spool", str(spool)]) == 0
    assert "agrees" in capsys.readouterr().out
    assert main(["audit", "status", "--db", str(db), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtimes"][0]["missing"] == 2 and doc["reconciliations"][0]["output_tokens"] == 9


def test_pod_filter_needs_the_kernel_path_auto_falls_back_bpf_refuses(tmp_path, capsys, monkeypatch):
    from zerolayer.bpf.auditor import Auditor

    monkeypatch.setattr(Auditor, "run", lambda self: None)  # start, say the mode, stop
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    common = ["--db", str(tmp_path / "a.db"), "--spool", str(tmp_path / "spool"), "--pod-uid", "0000-1111",
              "--cgroup-root", str(tmp_path / "no-cgroups")]
    assert main(["auditor", "--source", "journal", *common]) == 0  # no lookup: pods are the kernel path's filter
    assert "journal mode" in capsys.readouterr().out
    assert main(["auditor", "--source", "auto", *common]) == 0  # no cgroup v2 there: falls back, says so
    assert "journal mode" in capsys.readouterr().out
    assert main(["auditor", "--source", "bpf", *common]) == 2
    assert "cannot find the cgroup of pod uid 0000-1111" in capsys.readouterr().err


def test_gpu_source_auto_without_a_driver_bills_without_energy_and_nvml_refuses(monkeypatch, caplog):
    """What the operator deploys (``auto``) must start on a node without NVIDIA's library (a CPU node);
    an explicit ``nvml`` there is a clear error. On this machine NVML cannot start."""
    import pytest as _pytest

    from zerolayer.bpf import cli as audit_cli
    from zerolayer.bpf.errors import AuditError
    from zerolayer.runtime.gpu import nvml
    from zerolayer.runtime.gpu.api import GpuSourceError

    def no_driver(*_args, **_kwargs):
        raise GpuSourceError("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "NvmlSource", no_driver)
    with caplog.at_level("WARNING"):
        assert audit_cli._energy_source("auto") is None
    assert "without its energy part" in caplog.text
    with _pytest.raises(AuditError, match="--gpu-source=nvml"):
        audit_cli._energy_source("nvml")


def test_the_auditor_records_its_mode_as_an_event_on_its_pod(tmp_path, capsys, monkeypatch):
    """--mode-event-pod: the mode the auditor meters in, and why, on its pod (kubectl describe), through the
    one wrapper that calls the API (``zerolayer.bpf.kube.record_pod_event``); a failed write is logged and
    metering goes on."""
    from zerolayer.bpf import kube
    from zerolayer.bpf.auditor import Auditor
    from zerolayer.bpf.errors import AuditError

    monkeypatch.setattr(Auditor, "run", lambda self: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    events = []
    monkeypatch.setattr(kube, "record_pod_event", lambda ref, **kw: events.append((ref, kw)))
    common = ["--db", str(tmp_path / "a.db"), "--spool", str(tmp_path / "spool"), "--pod-uid", "0000-1111",
              "--cgroup-root", str(tmp_path / "no-cgroups"), "--mode-event-pod", "zl-run/zl-runtime-x"]
    assert main(["auditor", "--source", "auto", *common]) == 0
    ref, kw = events.pop()
    assert ref == "zl-run/zl-runtime-x" and kw["uid"] == "0000-1111" and kw["warning"] is True
    assert kw["reason"] == "AuditorJournalMode"
    assert kw["message"].startswith("journal mode: the kernel path could not start here (cannot find the cgroup")
    assert "journal mode, store" in capsys.readouterr().out
    assert main(["auditor", "--source", "journal", *common]) == 0
    ref, kw = events.pop()
    assert kw["warning"] is False and kw["message"] == "journal mode: --source=journal; metering from the runtime's journal"

    def refused(ref, **kw):
        raise AuditError("cannot record Event AuditorJournalMode on pod zl-run/zl-runtime-x: Forbidden")
    monkeypatch.setattr(kube, "record_pod_event", refused)
    from zerolayer.bpf import cli as audit_cli

    monkeypatch.setattr(audit_cli, "MODE_EVENT_RETRY_DELAYS_S", ())  # the retries have their own test
    assert main(["auditor", "--source", "journal", *common]) == 0  # the log still names the mode
    assert "journal mode, store" in capsys.readouterr().out


def test_a_refused_mode_event_is_tried_again_until_it_is_written(caplog):
    """The Event is tried again in the background (the pod's RBAC may come a moment after the pod)."""
    from zerolayer.bpf.cli import record_with_retries
    from zerolayer.bpf.errors import AuditError

    answers, waits = [AuditError("Forbidden"), AuditError("Forbidden"), None], []

    def record():
        answer = answers.pop(0)
        if answer is not None:
            raise answer
    assert record_with_retries(record, (1.0, 2.0, 4.0, 8.0), sleep=waits.append)
    assert waits == [1.0, 2.0, 4.0] and not answers

    def refused():
        raise AuditError("cannot record Event AuditorJournalMode on pod a/b: Forbidden")
    with caplog.at_level("WARNING"):
        assert not record_with_retries(refused, (1.0, 2.0), sleep=lambda s: None)
    assert "Forbidden; gave up after 2 more tries" in caplog.text


def test_mode_message_names_the_kernel_mode():
    from zerolayer.bpf.cli import mode_message

    assert mode_message("bpf", "auto", None) == "bpf mode: in the kernel, attached to the runtime's USDT token probe"
