"""Review finding 11: defragd sent SIGUSR1 to any idle-looking process of its pod.

SIGUSR1's default action is *terminate*: a process without a handler (a vLLM subprocess, a
sidecar helper, anything that shares the pod) was killed, not nudged. defragd now signals only
processes whose ``/proc/<pid>/status`` ``SigCgt`` mask says they catch SIGUSR1.

Real child processes, one with a SIGUSR1 handler and one without; the GPU is simulated (it only
says which PIDs hold how much memory) and time is the daemon's injected clock.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from zerolayer.runtime.defrag.daemon import DefragMetrics, Defragd, LogEvents
from zerolayer.runtime.defrag.policy import DefragPolicy
from zerolayer.runtime.defrag.scope import PidAllowlist
from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

pytestmark = [pytest.mark.regression, pytest.mark.timeout(60)]

GiB = 1024**3
HANDLES = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: out.open("a").write("SIGUSR1\\n"))
out.write_text("")
while True:
    time.sleep(0.05)
"""
# No handler: SIGUSR1 would terminate it (its default action).
UNRELATED = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def pod(tmp_path):
    procs = {}
    for role, code in (("runtime", HANDLES), ("unrelated", UNRELATED)):
        marker = tmp_path / f"{role}.log"
        procs[role] = (subprocess.Popen([sys.executable, "-c", code, str(marker)]), marker)
    deadline = time.monotonic() + 20
    while not all(m.exists() for _, m in procs.values()):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.02)
    yield procs
    for proc, _ in procs.values():
        proc.kill()
        proc.wait()


def test_unrelated_process_without_a_sigusr1_handler_survives(pod):
    runtime, unrelated = pod["runtime"][0], pod["unrelated"][0]
    source = SimulatedGpuSource({"name": "f11", "gpus": [{
        "memory_total_bytes": 80 * GiB, "steps": [{"memory": 0.1, "samples": 1}],
        "processes": [{"pid": runtime.pid, "used_memory_bytes": GiB},       # idle, handles SIGUSR1
                      {"pid": unrelated.pid, "used_memory_bytes": GiB}]}]})  # idle, no handler
    now = [0.0]
    metrics, events = DefragMetrics(), LogEvents()
    daemon = Defragd(source, PidAllowlist([runtime.pid, unrelated.pid]), policy=DefragPolicy(), metrics=metrics,
                     events=events, clock=lambda: now[0])
    daemon.scan_once()
    now[0] = 31 * 60
    report = daemon.scan_once()
    time.sleep(0.5)  # let a wrongly sent signal land
    assert unrelated.poll() is None, "the process without a SIGUSR1 handler was killed by the nudge"
    assert [n.pid for n in report.nudged] == [runtime.pid]
    deadline = time.monotonic() + 5
    while pod["runtime"][1].read_text().count("SIGUSR1") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pod["runtime"][1].read_text().count("SIGUSR1") == 1
    assert metrics.value("zerolayer_defrag_actions_total", action="nudge", mode="live", result="no_handler") == 1
    assert "IdleProcessNotNudged" in [e[0] for e in events.recorded]


def test_a_stale_published_load_never_counts_as_drained():
    """Issue 17: "drained" must not rely on a stale published load. A node whose runtime died with
    ``load: {running: 0, waiting: 0}`` in its status keeps that zero for good; once its heartbeat is
    older than ``staleAfterSeconds`` the reset is deferred (load unknown), not performed."""
    from zerolayer.gpumap import utc_now_rfc3339

    resets: list[int] = []
    node = {"metadata": {"name": "n"},
            "spec": {"defrag": {"allowReset": True}, "gossip": {"staleAfterSeconds": 30}},
            "status": {"load": {"running": 0, "waiting": 0}, "lastHeartbeat": utc_now_rfc3339(time.time() - 600),
                       "gpus": [{"uuid": "SIM-GPU-0000", "index": 0, "fragmentation": 0.4}]}}
    events = LogEvents()
    daemon = Defragd(SimulatedGpuSource.constant(0.5), PidAllowlist([]), node=lambda: node, events=events,
                     metrics=DefragMetrics(), reset=resets.append, clock=lambda: 0.0)
    daemon.scan_once()
    assert resets == [] and events.recorded[-1][0] == "GpuResetDeferred"
    node["status"]["lastHeartbeat"] = utc_now_rfc3339()  # fresh: now the zero is believed
    daemon.scan_once()
    assert resets == [0]
