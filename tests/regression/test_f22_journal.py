"""Review finding 22: the in-process journal path on a full or damaged spool.

- ``emit`` raised inside the request when the journal write failed (a full spool broke serving),
  and a short write left a torn record in the journal;
- a torn or corrupt record made the auditor raise ``AuditError`` on every start (crash loop,
  metering stopped); it is now skipped and counted as lost, and the counters reconcile it;
- the journal was never rotated, so it grew until the node ran out of disk.

The full disk is real: a 256 KiB tmpfs (root only; skipped otherwise).
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from zerolayer.bpf.auditor import Auditor, AuditorSettings
from zerolayer.bpf.events import encode_record
from zerolayer.bpf.journal import JournalSource
from zerolayer.bpf.probes import TokenProbe
from zerolayer.bpf.store import SqliteStore

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]


def billed(store: SqliteStore) -> dict[str, int]:
    return {t: o for t, o in store.db.execute(
        "SELECT tenant, sum(output_tokens + reconciled_output) FROM usage_minute GROUP BY tenant")}


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "spool"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_spool_does_not_break_serving_and_nothing_is_lost(small_disk, tmp_path):
    filler = small_disk / "filler"
    probe = TokenProbe(small_disk, journal=True, window_s=0)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # fill the disk after the probe started
    try:
        while True:
            os.write(fd, b"x" * 512)
    except OSError:
        pass  # full: the journal cannot grow any more
    finally:
        os.close(fd)
    sent = 0
    for i in range(400):  # ~50 KiB of records: would not fit
        probe.emit("acme", f"req-{i % 7}-{'x' * 60}", "tiny", 0, 3)  # must not raise into the request
        sent += 3
    assert probe.journal_failures > 0  # the full disk was hit, and serving went on
    filler.unlink()  # space again: the journal resumes after whole records only
    for i in range(50):
        probe.emit("acme", f"after-{i}", "tiny", 0, 1)
        sent += 1
    probe.close()
    store = SqliteStore(tmp_path / "audit.db")
    auditor = Auditor(store, JournalSource(small_disk), spool=small_disk)
    auditor.drain()
    auditor.reconcile()
    assert billed(store) == {"acme": sent}
    assert [r for r in store.totals()["reconciliations"] if r["kind"] != "reconciled"] == []


def record(seq: int, out: int = 5) -> bytes:
    return encode_record(0xB, seq, 1_800_000_000 * 10**9, "acme", "tiny", "r", 0, out, 0)


def test_torn_and_corrupt_records_are_skipped_and_counted_not_fatal(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    # segment 0: two records, then a torn one (the writer died mid-write); segment 1 exists, so 0 is sealed
    spool.joinpath("000000000000000b.journal").write_bytes(record(1) + record(2) + record(3)[:20])
    # segment 1: a record, a corrupt length, garbage
    spool.joinpath("000000000000000b.1.journal").write_bytes(record(4) + b"\x03\x00\x00\x00" + b"\xff" * 40)
    store = SqliteStore(tmp_path / "audit.db")
    auditor = Auditor(store, JournalSource(spool), spool=spool,
                      settings=AuditorSettings(flush_interval_s=0.01, reconcile_interval_s=0.01))
    thread = threading.Thread(target=auditor.run)
    thread.start()
    auditor.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert billed(store) == {"acme": 15}  # records 1, 2 and 4
    assert auditor.source.lost() == 2  # the torn record and the corrupt one
    assert store.state("kernel_lost_total") == "2"
    # records appended after the corrupt bytes are read again
    with spool.joinpath("000000000000000b.1.journal").open("ab") as f:
        f.write(record(5, out=7))
    auditor2 = Auditor(store, JournalSource(spool, dict(store.db.execute(
        "SELECT key, value FROM auditor_state WHERE key LIKE 'journal:%'").fetchall())), spool=spool)
    auditor2.drain()
    assert billed(store) == {"acme": 22}


def test_the_journal_rotates_and_consumed_segments_are_deleted(tmp_path):
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=True, window_s=0, journal_max_bytes=4096)
    store = SqliteStore(tmp_path / "audit.db")
    auditor = Auditor(store, JournalSource(spool), spool=spool)
    sent = 0
    for round_ in range(5):
        for i in range(100):
            probe.emit("acme", f"r{round_}-{i}", "tiny", 0, 2)
            sent += 2
        auditor.drain()
        journals = list(spool.glob("*.journal"))
        assert sum(p.stat().st_size for p in journals) <= 2 * 4096 + 200, "the journal grows without bound"
    probe.close()
    auditor.drain()
    assert billed(store) == {"acme": sent}
    assert store.totals()["runtimes"][0]["missing"] == 0


def test_a_finished_runtimes_consumed_journal_is_deleted(tmp_path):
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=True, window_s=0)
    for i in range(20):
        probe.emit("acme", f"r{i}", "tiny", 0, 2)
    probe.close()  # final counters: it will never append again
    store = SqliteStore(tmp_path / "audit.db")
    auditor = Auditor(store, JournalSource(spool), spool=spool)
    auditor.drain()
    auditor.drain()
    assert billed(store) == {"acme": 40}
    assert list(spool.glob("*.journal")) == [], "a finished runtime's journal stays in the spool for good"


class KernelSource:
    """Stands in for BpfTokenSource: the auditor meters through the kernel, nobody reads the journals."""

    kind = "bpf"

    def poll(self, timeout_ms: int = 100) -> list:
        return []

    def lost(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_journals_are_not_kept_when_the_kernel_path_meters(tmp_path):
    # audit.mode auto makes the server journal (finding 9d) even where the auditor then picks BPF.
    spool = tmp_path / "spool"
    probe = TokenProbe(spool, journal=True, window_s=0, journal_max_bytes=4096)
    for i in range(300):
        probe.emit("acme", f"r{i}", "tiny", 0, 2)
    old = spool / "00000000000000aa.journal"  # a runtime that died long ago
    old.write_bytes(record(1))
    os.utime(old, (1, 1))
    auditor = Auditor(SqliteStore(tmp_path / "audit.db"), KernelSource(), spool=spool)
    auditor.prune()
    left = sorted(p.name for p in spool.glob("*.journal"))
    assert left == [f"{probe.runtime_id:016x}.{probe._journal_segment}.journal"]  # only the open segment
    probe.close()
