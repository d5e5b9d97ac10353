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
