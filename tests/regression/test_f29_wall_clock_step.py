"""Review finding 29: the kernel path turned ktime (CLOCK_MONOTONIC) into wall time with an offset
computed once at attach, so after an NTP step every event landed in the wrong minutes.

The real BPF path (root, bcc, tracefs): attach, step the wall clock by an hour (the ``time``
module's wall clock, as an NTP step would move it), fire the probe, and check the event's wall
time follows the step. Skipped where the kernel path cannot run.
"""

from __future__ import annotations

import time

import pytest

from zerolayer.bpf.errors import BpfUnavailable
from zerolayer.bpf.loader import check_kernel

pytestmark = [pytest.mark.regression, pytest.mark.bpf, pytest.mark.timeout(120)]
STEP_NS = 3600 * 1_000_000_000


def _skip_reason() -> str | None:
    try:
        check_kernel()
    except BpfUnavailable as exc:
        return f"real BPF path unavailable: {exc}"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_events_follow_a_wall_clock_step_after_attach(monkeypatch):
    from zerolayer.bpf.loader import BpfTokenSource
    from zerolayer.bpf.probes import TokenProbe

    source = BpfTokenSource(ring_buffer_bytes=1 << 20)
    try:
        probe = TokenProbe()
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() + STEP_NS)  # NTP steps the clock after attach
        before = time.time_ns()
        probe.emit("acme", "r1", "tiny", 3, 0, first=True)
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = [e for e in source.poll(50) if e.runtime_id == probe.runtime_id]
        after = time.time_ns()
        assert len(got) == 1
        assert before - 50_000_000 <= got[0].wall_ns <= after + 50_000_000, \
            f"event stamped {(got[0].wall_ns - before) / 1e9:+.1f} s from the stepped wall clock"
    finally:
        source.close()
