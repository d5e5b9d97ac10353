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
from zerolayer.operator.crds import established

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

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Wait until each CustomResourceDefinition (``name.group``) is served, by the operator's own test
        (``crds.established``). Not ``kubectl wait --for=condition=Established``: that fails at once, instead
        of waiting, on a CRD just applied whose status has no conditions yet (seen in CI on a loaded machine)."""
        def served(name: str) -> bool:
            found = self.kubectl("get", "crd", name, "--ignore-not-found", "-o", "json").stdout
            return bool(found.strip()) and established(json.loads(found))

        for name in crds:
            self.wait_for(lambda name=name: served(name), timeout=timeout, what=f"crd/{name} Established")

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
    try:  # a failure after the start takes the cluster down too (its processes would outlive the run)
        c = E2ECluster(local)
        c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        c.wait_established("inferencenodes.zerolayer.io", "tenantquotas.zerolayer.io")
        yield c
    finally:
        if started and os.environ.get("ZEROLAYER_KEEP_CLUSTER") != "1":
            local.down(quiet=True)


@pytest.fixture(scope="session")
def _real_cluster_session():
    """One cluster with a real node (``real-node-0``) per session, in its own state directory; see
    ``tests/e2e/real_node_harness.py``. Skips with the reason when this host cannot run real nodes."""
    import pathlib
    import shutil
    import tempfile

    from zerolayer.cluster import host
    from zerolayer.cluster.local import live_real_node_holder

    from tests.e2e.real_node_harness import RealCluster

    if os.environ.get("ZEROLAYER_E2E") == "0":
        pytest.skip("ZEROLAYER_E2E=0: e2e tier disabled")
    reason = host.unsupported_reason()
    if reason:
        pytest.skip(f"no real nodes on this host: {reason}")
    holder = live_real_node_holder(log=print)
    if holder is not None:
        pytest.skip(f"another local cluster's real nodes hold this host ({holder})")
    # Short path: containerd's socket path (+ ".ttrpc") must fit in 108 bytes.
    state = tempfile.mkdtemp(prefix="zl-real-")
    c = RealCluster(LocalCluster(state_dir=pathlib.Path(state),
                                 log=lambda msg: print(f"[real-cluster] {msg}", flush=True)))
    try:
        yield c
    finally:
        if os.environ.get("ZEROLAYER_KEEP_CLUSTER") != "1":
            c.local.down(quiet=True)
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def real_cluster(_real_cluster_session):
    """The session's real-node cluster, started on first use (or again after a test took it down)."""
    _real_cluster_session.ensure_up()
    return _real_cluster_session
