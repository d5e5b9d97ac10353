"""gpu-defragd against real processes: the idle one in our pod gets SIGUSR1, the busy one and the
idle one outside the pod do not.

The GPU is a *simulated* source (no GPU here) that says which PIDs use how much memory; the
processes are real children with a SIGUSR1 handler that records receipt in a file. Time is
the daemon's injected clock, so "idle for 30 minutes" takes no wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from zerolayer.runtime.defrag.daemon import DefragMetrics, Defragd, LogEvents
from zerolayer.runtime.defrag.policy import DefragPolicy
from zerolayer.runtime.defrag.scope import PidAllowlist, ProcessTree
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

GiB = 1024**3
CHILD = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_usr1(signum, frame):
    with out.open("a") as f:
        f.write("SIGUSR1\\n")
signal.signal(signal.SIGUSR1, on_usr1)
out.write_text("")  # ready
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def children(tmp_path):
    procs = {}
    for role in ("idle", "busy", "foreign"):
        marker = tmp_path / f"{role}.log"
        procs[role] = (subprocess.Popen([sys.executable, "-c", CHILD, str(marker)]), marker)
    deadline = time.monotonic() + 20
    while not all(m.exists() for _, m in procs.values()):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.02)
    yield procs
    for proc, _ in procs.values():
        proc.kill()
        proc.wait()


def received(marker) -> int:
    return marker.read_text().count("SIGUSR1")


def scenario(procs, busy_memory: int = 20 * GiB) -> SimulatedGpuSource:
    return SimulatedGpuSource({"name": "defrag-processes", "gpus": [{
        "memory_total_bytes": 80 * GiB,
        "steps": [{"memory": 0.4, "samples": 1}],
        "processes": [
            {"pid": procs["idle"][0].pid, "used_memory_bytes": 1 * GiB},     # 1.25 %: idle
            {"pid": procs["busy"][0].pid, "used_memory_bytes": busy_memory},  # 25 %: busy
            {"pid": procs["foreign"][0].pid, "used_memory_bytes": 1 * GiB},  # idle, but not ours
        ]}]})


def wait_received(marker, count: int) -> None:
    deadline = time.monotonic() + 10
    while received(marker) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_idle_child_is_nudged_busy_and_foreign_ones_are_not(children):
    now = [0.0]
    metrics, events = DefragMetrics(), LogEvents()
    ours = PidAllowlist([children["idle"][0].pid, children["busy"][0].pid])
    daemon = Defragd(scenario(children), ours, policy=DefragPolicy(), metrics=metrics, events=events,
                     clock=lambda: now[0])
    first = daemon.scan_once()
    assert first.nudged == () and first.foreign == (children["foreign"][0].pid,)
    now[0] = 29 * 60  # idle for 29 minutes: not yet
    assert daemon.scan_once().nudged == ()
    now[0] = 30 * 60 + 1
    report = daemon.scan_once()
    assert [n.pid for n in report.nudged] == [children["idle"][0].pid]
    wait_received(children["idle"][1], 1)
    assert received(children["idle"][1]) == 1
    now[0] += 300  # next scan: nudged 5 minutes ago, not again
    assert daemon.scan_once().nudged == ()
    time.sleep(0.3)  # give a wrongly sent signal time to land before checking nobody else got one
    assert received(children["busy"][1]) == 0 and received(children["foreign"][1]) == 0
    assert received(children["idle"][1]) == 1
    assert metrics.value("zerolayer_defrag_actions_total", action="nudge", mode="live", result="ok") == 1
    assert [e[0] for e in events.recorded] == ["IdleProcessNudged"]
    assert str(children["idle"][0].pid) in events.recorded[0][1]


def test_dry_run_reports_and_signals_nobody(children):
    now = [0.0]
    events = LogEvents()
    daemon = Defragd(scenario(children), ProcessTree(os.getpid()), policy=DefragPolicy(dry_run=True),
                     events=events, clock=lambda: now[0])
    daemon.scan_once()
    now[0] = 31 * 60
    report = daemon.scan_once()
    # ProcessTree(our PID): all three children are ours here; the idle ones would be nudged
    assert sorted(n.pid for n in report.would_nudge) == sorted([children["idle"][0].pid,
                                                                children["foreign"][0].pid])
    assert report.nudged == ()
    time.sleep(0.3)
    assert all(received(m) == 0 for _, m in children.values())
    assert all(e[1].startswith("dry run") for e in events.recorded)


def test_a_process_that_gets_busy_starts_its_idle_clock_over(children, tmp_path):
    now = [0.0]
    source = scenario(children)
    daemon = Defragd(source, PidAllowlist([children["idle"][0].pid]), policy=DefragPolicy(), clock=lambda: now[0])
    daemon.scan_once()
    now[0] = 20 * 60
    busy_again = scenario({**children, "idle": children["busy"], "busy": children["idle"]})
    daemon.source = busy_again  # the idle child now holds 25 % of the GPU
    daemon.scan_once()
    daemon.source = source
    now[0] = 31 * 60
    assert daemon.scan_once().nudged == ()  # seen idle again from here on (minute 31)
    now[0] = 50 * 60
    assert daemon.scan_once().nudged == ()  # 19 minutes
    now[0] = 61 * 60 + 1
    assert [n.pid for n in daemon.scan_once().nudged] == [children["idle"][0].pid]
    wait_received(children["idle"][1], 1)
    assert received(children["idle"][1]) == 1
