"""`zerolayer auditor --pod NAMESPACE/NAME` (or `--pod-uid`, as the operator's sidecar runs it): the pod's
UID from the real API server, its cgroup on this host, and the kernel filter keeping exactly the
processes in the pod's containers.

The kubelet is the one part not running here (kwok nodes have no containers), so the test makes
the pod's cgroup itself, where the kubelet's systemd driver puts it, in the real cgroup v2 tree,
and runs an emitting process in a container cgroup below it.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "integration" / "audit"))
from audit_helpers import bpf_skip_reason  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.bpf, pytest.mark.timeout(180)]
NS = "audit-pod-e2e"

EMITTER = """
import sys
from zerolayer.bpf.probes import TokenProbe
probe = TokenProbe()
print(probe.runtime_id, flush=True)
sys.stdin.readline()
probe.emit("acme", "msg_in_pod", "tiny", 3, 0, first=True)
print("sent", flush=True)
sys.stdin.readline()
"""


def auditor(db: pathlib.Path, log: pathlib.Path, kubeconfig: str, *pods: str, by: str = "--pod"
            ) -> subprocess.Popen[bytes]:
    args = [a for p in pods for a in (by, p)]
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "auditor", "--source", "bpf", "--db", str(db),
                                 "--kubeconfig", kubeconfig, "--flush-interval", "0.2", *args],
                                stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("by", ["--pod", "--pod-uid"])  # --pod-uid: the operator's sidecar (downward API)
def test_auditor_meters_only_the_pods_processes(cluster, tmp_path, by):
    if reason := bpf_skip_reason():
        pytest.skip(reason)
    from zerolayer.bpf.loader import cgroup2_root
    from zerolayer.bpf.probes import TokenProbe

    cluster.kubectl("create", "namespace", NS, check=False)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime", "namespace": NS},
           "spec": {"containers": [{"name": "server", "image": "example.invalid/zerolayer:1"}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    uid = cluster.kubectl_json("get", "pod", "runtime", "-n", NS)["metadata"]["uid"]
    # The kubelet's systemd-driver layout, under a scratch top-level cgroup of our own.
    top = cgroup2_root() / f"zl-e2e-{secrets.token_hex(4)}"
    slice_name = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    pod_dir = top / "kubepods.slice" / "kubepods-burstable.slice" / slice_name
    container = pod_dir / "cri-containerd-0123abcd.scope"
    container.mkdir(parents=True)
    emitter = subprocess.Popen([sys.executable, "-c", EMITTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    proc = None
    try:
        (container / "cgroup.procs").write_text(str(emitter.pid))
        in_pod = int(emitter.stdout.readline())
        db, log = tmp_path / "audit.db", tmp_path / "auditor.log"
        proc = auditor(db, log, cluster.kubeconfig, f"{NS}/runtime" if by == "--pod" else uid, by=by)
        deadline = time.monotonic() + 60
        while b"bpf mode" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert str(pod_dir) in log.read_text()  # it says which cgroup it resolved
        outside = TokenProbe()  # this test process: same library, not in the pod
        outside.emit("acme", "msg_outside", "tiny", 5, 0, first=True)
        emitter.stdin.write("\n")
        emitter.stdin.flush()
        assert emitter.stdout.readline().strip() == "sent"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        con = sqlite3.connect(db)
        rows = con.execute("SELECT runtime_id, request_id, input_tokens, cgroup_id FROM token_events").fetchall()
        con.close()
        assert rows == [(f"{in_pod:016x}", "msg_in_pod", 3, os.stat(container).st_ino)]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        emitter.kill()
        emitter.communicate()  # reaps it and closes its pipes
        for d in (container, pod_dir, pod_dir.parent, pod_dir.parent.parent, top):
            for _ in range(50):  # the killed process leaves the cgroup a moment later
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_pod_not_on_this_host_or_not_at_all_is_a_clear_error(cluster, tmp_path):
    if reason := bpf_skip_reason():
        pytest.skip(reason)
    ns = "audit-pod-e2e-absent"
    cluster.kubectl("create", "namespace", ns, check=False)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "elsewhere", "namespace": ns},
           "spec": {"containers": [{"name": "server", "image": "example.invalid/zerolayer:1"}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        for ref, message in ((f"{ns}/elsewhere", "has no cgroup on this host"),
                             (f"{ns}/missing", "cannot look up pod"),
                             ("no-slash", "NAMESPACE/NAME")):
            log = tmp_path / "auditor.log"
            proc = auditor(tmp_path / "audit.db", log, cluster.kubeconfig, ref)
            assert proc.wait(60) == 2
            assert message in log.read_text(), log.read_text()
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
