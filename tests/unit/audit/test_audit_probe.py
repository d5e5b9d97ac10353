"""TokenProbe (runtime side), the journal record format, and the journal source with resume."""

from __future__ import annotations

import json

from zerolayer.bpf.events import decode_records, encode_record
from zerolayer.bpf.journal import JournalSource
from zerolayer.bpf.probes import TokenProbe


def test_record_round_trip_and_partial_tail():
    a = encode_record(7, 1, 123, "acme", "tiny", "msg_1", 10, 0, 1)
    b = encode_record(7, 2, 124, "acme", "tiny", "msg_1", 0, 1, 0)
    events, used = decode_records(a + b[:-3])
    assert used == len(a)
    assert [(e.seq, e.tenant, e.input_tokens, e.output_tokens, e.first) for e in events] == [(1, "acme", 10, 0, True)]


def test_probe_counts_and_snapshots(tmp_path):
    probe = TokenProbe(tmp_path, journal=True)
    probe.emit("acme", "r1", "tiny", 10, 0, first=True)  # outside an event loop: fired at once
    assert probe.seq == 1
    probe.emit("acme", "r1", "tiny", 0, 3)
    probe.emit("globex", "r2", "tiny", 0, 1)
    probe.close()
    doc = json.loads((tmp_path / f"{probe.runtime_id:016x}.counters.json").read_text())
    assert doc["seq"] == 3 and doc["final"] is True
    assert {(t["tenant"], t["input_tokens"], t["output_tokens"], t["events"], t["requests"]) for t in doc["totals"]} \
        == {("acme", 10, 3, 2, 1), ("globex", 0, 1, 1, 0)}


def test_probe_without_spool_keeps_counters_in_memory():
    probe = TokenProbe()
    probe.emit("acme", "r1", "tiny", 0, 2)
    assert probe.counters()["totals"][0]["output_tokens"] == 2
    assert probe.mode in ("usdt", "counters")
    probe.close()


async def test_one_event_per_request_per_window(tmp_path):
    """On the event loop, a window's tokens become one event per request, fired in one batch."""
    import asyncio

    probe = TokenProbe(tmp_path, journal=True, window_s=0.05)
    probe.emit("acme", "r1", "tiny", 10, 0, first=True)
    for _ in range(5):
        probe.emit("acme", "r1", "tiny", 0, 1)
        probe.emit("globex", "r2", "tiny", 0, 2)
    assert probe.seq == 0 and probe.counters()["totals"] == []  # nothing fired yet: counters cover fired events
    await asyncio.sleep(0.2)
    assert (probe.seq, probe.batches) == (2, 1)
    events = JournalSource(tmp_path).poll(0)
    assert [(e.seq, e.tenant, e.request_id, e.input_tokens, e.output_tokens, e.first) for e in events] == [
        (1, "acme", "r1", 10, 5, True), (2, "globex", "r2", 0, 10, False)]
    probe.emit("acme", "r1", "tiny", 0, 1)  # the next window: a new event for the same request
    probe.close()  # a clean stop fires what is pending
    assert probe.seq == 3
    assert {(t["tenant"], t["output_tokens"], t["events"], t["requests"]) for t in probe.counters()["totals"]} == {
        ("acme", 6, 2, 1), ("globex", 10, 1, 0)}


async def test_window_zero_fires_two_callbacks_later_and_many_requests_fire_early(tmp_path):
    import asyncio

    from zerolayer.bpf.probes import PENDING_MAX

    probe = TokenProbe(tmp_path, journal=True, window_s=0)
    probe.emit("acme", "r1", "tiny", 0, 1)
    probe.emit("acme", "r1", "tiny", 0, 1)
    await asyncio.sleep(0)  # the window ends (sealed)
    assert probe.seq == 0
    await asyncio.sleep(0)  # and fires one callback later
    assert (probe.seq, probe.batches) == (1, 1)
    slow = TokenProbe(tmp_path, journal=True, window_s=60)
    for i in range(PENDING_MAX):
        slow.emit("acme", f"r{i}", "tiny", 0, 1)
    await asyncio.sleep(0)
    assert slow.seq == PENDING_MAX  # fired without waiting for the window
    events = [e for e in JournalSource(tmp_path).poll(0) if e.runtime_id == slow.runtime_id]
    assert [e.seq for e in events] == list(range(1, PENDING_MAX + 1))
    probe.close()
    slow.close()


async def test_an_event_fires_after_the_writes_its_tokens_followed(tmp_path):
    """The runtime meters a piece right after handing it to its connection, whose write is then scheduled
    (``flush_soon``). Another connection's write may be scheduled after the first metering call started
    the window; its tokens must still not fire before it ran, or a runtime killed in between bills tokens
    the client never got (the audit proof's runtime kill)."""
    import asyncio

    loop = asyncio.get_running_loop()
    probe = TokenProbe(tmp_path, journal=True, window_s=0)  # a window's end seals the same way whatever its length
    writes: list[tuple[str, int]] = []

    def stream(name: str) -> None:
        loop.call_soon(lambda: writes.append((name, probe.seq)))  # the connection's flush_soon
        probe.emit("acme", name, "tiny", 0, 1)  # then the meter

    stream("a")
    stream("b")  # its write is scheduled after a's meter scheduled the window's end
    for _ in range(3):
        await asyncio.sleep(0)
    assert writes == [("a", 0), ("b", 0)]
    assert probe.seq == 2
    probe.close()


def test_oversized_event_is_refused_clearly():
    import pytest

    from zerolayer.bpf.probes import LIMIT, PyBatch

    probe = TokenProbe()
    for batch in (probe._batch, PyBatch()):
        with pytest.raises(ValueError, match="exceeds"):
            batch.append(1, 1, 0, "acme", "m" * LIMIT, "r", 0, 1, 0)
        assert batch.count == 0


def test_journal_source_resumes_from_committed_state(tmp_path):
    probe = TokenProbe(tmp_path, journal=True)
    for i in range(5):
        probe.emit("acme", "r1", "tiny", 0, 1)
    source = JournalSource(tmp_path)
    assert [e.seq for e in source.poll(0)] == [1, 2, 3, 4, 5]
    state = source.state()
    for i in range(2):
        probe.emit("acme", "r1", "tiny", 0, 1)
    # a new auditor resumes from the committed state, not from the start
    resumed = JournalSource(tmp_path, state)
    assert [e.seq for e in resumed.poll(0)] == [6, 7]
    probe.close()


def test_runtime_hook_flags_and_sink(tmp_path, monkeypatch):
    import argparse

    import pytest

    from zerolayer.bpf.hook import add_audit_arguments, open_token_probe

    monkeypatch.delenv("ZEROLAYER_AUDIT_SPOOL", raising=False)
    monkeypatch.delenv("ZEROLAYER_AUDIT_JOURNAL", raising=False)
    parser = argparse.ArgumentParser()
    add_audit_arguments(parser)
    probe = open_token_probe(parser.parse_args(["--audit-spool", str(tmp_path), "--audit-journal"]))
    probe.emit("acme", "r", "tiny", 3, 0, True)  # the composition root hands probe.emit to the server
    assert probe.seq == 1 and probe.mode.endswith("journal") and probe.window_s == 0.05
    probe.close()
    with pytest.raises(SystemExit):
        open_token_probe(parser.parse_args(["--audit-journal"]))


def test_pod_cgroups_finds_the_pod_level_cgroup_for_both_kubelet_drivers(tmp_path):
    from zerolayer.bpf.loader import pod_cgroups

    uid = "5f3c1a2b-0000-4bcd-8e9f-0123456789ab"
    systemd = tmp_path / "kubepods.slice" / "kubepods-burstable.slice" / \
        f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    (systemd / "cri-containerd-1.scope").mkdir(parents=True)
    cgroupfs = tmp_path / "kubepods" / "besteffort" / f"pod{uid}"
    (cgroupfs / "0123abcd").mkdir(parents=True)
    (tmp_path / "kubepods" / "besteffort" / "pod11111111-2222-3333-4444-555555555555").mkdir()
    assert pod_cgroups(uid, tmp_path) == sorted([str(systemd), str(cgroupfs)])  # not the containers below
    assert pod_cgroups("00000000-0000-0000-0000-000000000000", tmp_path) == []
