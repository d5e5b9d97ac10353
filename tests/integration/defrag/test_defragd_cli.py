"""``zerolayer defragd --once`` as a process: simulated GPU, explicit pod PIDs, dry run, no cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_defragd_once_dry_run_reports_without_signalling(tmp_path):
    # A SIGUSR1 handler: defragd only ever signals processes that catch it (docs/defragd.md).
    sleeper = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                "signal.signal(signal.SIGUSR1, lambda *_: None); print(flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE)
    sleeper.stdout.readline()  # the handler is installed
    try:
        scenario = tmp_path / "gpu.yaml"
        scenario.write_text(yaml.safe_dump({"name": "one-idle", "gpus": [{
            "steps": [{"memory": 0.3, "samples": 1}],
            "processes": [{"pid": sleeper.pid, "used_memory_bytes": 1024}, {"pid": 1, "used_memory_bytes": 1024}]}]}))
        out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "defragd", "--source", "simulated",
                              "--scenario", str(scenario), "--pod-pids", str(sleeper.pid), "--idle-minutes", "0",
                              "--dry-run", "--once"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, KUBECONFIG=str(tmp_path / "none")))
        assert out.returncode == 0, out.stderr
        assert f"would nudge [{sleeper.pid}]" in out.stdout and "foreign [1]" in out.stdout
        assert "dry run: would send SIGUSR1" in out.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()


def test_defragd_once_reports_a_process_without_a_handler_and_leaves_it_alone(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        scenario = tmp_path / "gpu.yaml"
        scenario.write_text(yaml.safe_dump({"name": "one-idle", "gpus": [{
            "steps": [{"memory": 0.3, "samples": 1}], "processes": [{"pid": sleeper.pid, "used_memory_bytes": 1024}]}]}))
        out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "defragd", "--source", "simulated",
                              "--scenario", str(scenario), "--pod-pids", str(sleeper.pid), "--idle-minutes", "0",
                              "--once"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, KUBECONFIG=str(tmp_path / "none")))
        assert out.returncode == 0, out.stderr
        assert "nudged []" in out.stdout and "no SIGUSR1 handler" in out.stderr
        assert sleeper.poll() is None  # a SIGUSR1 without a handler would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()


def test_defragd_outside_a_pod_without_a_scope_explains_itself(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "defragd", "--source", "simulated", "--scenario",
                          str(tmp_path / "x.yaml"), "--once"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pod-root" in out.stderr
