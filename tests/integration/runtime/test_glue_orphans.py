"""vLLM's engine processes die with the runtime, even when the runtime is SIGKILLed.

The first tests use a plain child process standing where vLLM's engine core stands (the
reaper does not care what it kills) so the mechanism is checked in seconds; the last starts
``zerolayer runtime`` with the real vLLM engine and kills it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

# Starts a child that would sleep for ten minutes (as vLLM's engine core runs until told),
# optionally hands it to the reaper, prints its pid, then waits to be killed.
PARENT = """
import subprocess, sys, time
from zerolayer.runtime.engine.vllm_engine import ChildReaper, descendants
import os
before = set(descendants(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reaper = ChildReaper()  # kept: its pipe must stay open until this process dies
if sys.argv[1] in ("reaper", "released"):
    assert reaper.watch(before) == [child.pid]
if sys.argv[1] == "released":
    reaper.close()  # a clean engine stop
time.sleep(0.5)
assert child.poll() is None  # the reaper waits for this process's end
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], limit_s: float) -> list[int]:
    """The pids still alive after waiting up to ``limit_s`` (a bound for a noisy machine, not a timing check)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def orphan_after_kill(mode: str) -> int | None:
    """Start PARENT, SIGKILL it, return its child's pid if the child survived (killing it then)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    left = wait_gone([child], 20 if mode == "reaper" else 1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return child if left else None


@pytest.mark.timeout(60)
def test_reaper_kills_the_engine_processes_of_a_killed_runtime():
    assert orphan_after_kill("reaper") is None


@pytest.mark.timeout(60)
def test_without_the_reaper_the_child_is_orphaned():
    """The control: what happened to vLLM's engine core before."""
    assert orphan_after_kill("none") is not None


@pytest.mark.timeout(60)
def test_a_closed_reaper_kills_nothing():
    assert orphan_after_kill("released") is not None


@pytest.mark.timeout(60)
def test_reaper_never_lists_processes_that_were_there_before():
    from zerolayer.runtime.engine.vllm_engine import ChildReaper

    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper = ChildReaper()
    try:
        assert older.pid not in reaper.watch({older.pid})
        reaper.close()
        assert alive(older.pid)
    finally:
        reaper.close()
        older.kill()
        older.wait()


def vllm_processes(session: int) -> list[int]:
    out = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session:
                continue
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ProcessLookupError):
            continue
        if title.startswith(b"VLLM::") and alive(int(entry.name)):
            out.append(int(entry.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.engine
@pytest.mark.timeout(400)
def test_sigkilled_runtime_leaves_no_vllm_process():
    pytest.importorskip("vllm", reason="the vllm engine extra is not installed")
    runtime = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli", "runtime", "--config", "examples/standalone-vllm.yaml",
         "--port", str(free_port())],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own session: every process it starts is found by session id
    session = runtime.pid
    try:
        lines = []
        for line in runtime.stdout:
            lines.append(line)
            if "zerolayer runtime serving on" in line:
                break
        else:
            pytest.fail("runtime exited before serving:\n" + "".join(lines[-40:]))
        engine = vllm_processes(session)
        assert engine, "expected vLLM's engine core in the runtime's session"
        runtime.send_signal(signal.SIGKILL)
        runtime.wait()
        left = wait_gone(engine, 60)
        assert not left, f"vLLM processes outlived the runtime: {left}"
        assert not vllm_processes(session)
    finally:
        if runtime.poll() is None:
            runtime.kill()
            runtime.wait()
        runtime.stdout.close()
        for pid in vllm_processes(session):  # never leave ~2 GB orphans behind, even when failing
            os.kill(pid, signal.SIGKILL)
