"""The e2e tier runs against a real local control plane (``zerolayer cluster up``).

The ``cluster`` fixture brings the control plane up once per test session and takes
it down at the end, unless one was already running (then it is reused and left
alone, so a developer's cluster survives a test run). The CRDs from ``crds/`` are
applied once. Set ``ZEROLAYER_E2E=0`` to skip the tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from zerolayer.cluster.local import LocalCluster

from tests.conftest import REPO


class E2ECluster:
    def __init__(self, local: LocalCluster):
        self.local = local
        self.kubeconfig = str(local.kubeconfig)
        self.bin_dir = local.toolchain.bin_dir

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120):
        return self.local.kubectl(*args, input=input, check=check, timeout=timeout)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / "helm"), "--kubeconfig", self.kubeconfig, *args]
        proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {proc.stderr}")
        return proc

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (operator, runtime) that talks to this cluster."""
        return dict(os.environ, KUBECONFIG=self.kubeconfig,
                    PATH=f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def wait_for(self, check, timeout: float = 60, interval: float = 0.5, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def cluster():
    if os.environ.get("ZEROLAYER_E2E") == "0":
        pytest.skip("ZEROLAYER_E2E=0: e2e tier disabled")
    local = LocalCluster(log=lambda msg: print(f"[cluster] {msg}", flush=True))
    started = local.up() == "started"
    c = E2ECluster(local)
    c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    c.kubectl("wait", "--for=condition=Established", "crd/inferencenodes.zerolayer.io",
              "crd/tenantquotas.zerolayer.io", "--timeout=60s")
    try:
        yield c
    finally:
        if started and os.environ.get("ZEROLAYER_KEEP_CLUSTER") != "1":
            local.down(quiet=True)
