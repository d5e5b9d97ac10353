"""Issue 2: the local control plane is real — nodes, scheduling, and its lifecycle commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from zerolayer.cluster.local import LocalCluster

pytestmark = pytest.mark.e2e


def test_fake_gpu_nodes_are_ready_and_labelled_like_gpu_feature_discovery(cluster):
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    assert len(nodes) >= 3
    for n in nodes:
        labels = n["metadata"]["labels"]
        assert labels["nvidia.com/gpu.present"] == "true"
        assert labels["nvidia.com/gpu.product"]
        assert int(labels["nvidia.com/gpu.memory"]) > 0
        assert int(labels["nvidia.com/gpu.count"]) >= 1
        assert int(n["status"]["capacity"]["nvidia.com/gpu"]) >= 1
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}
        assert ready["Ready"] == "True"


def test_fake_nodes_heartbeat_through_leases_like_kubelets(cluster):
    """kwok renews a 40 s Lease per node every ~10 s (as kubelets do) instead of rewriting Node status."""
    from datetime import datetime, timezone

    def renewed() -> dict[str, float]:
        leases = cluster.kubectl_json("get", "leases", "-n", "kube-node-lease")["items"]
        now = datetime.now(timezone.utc)
        return {lease["metadata"]["name"]: (now - datetime.fromisoformat(
                    lease["spec"]["renewTime"].replace("Z", "+00:00"))).total_seconds()
                for lease in leases if lease["metadata"]["name"].startswith("gpu-node-")}

    first = renewed()
    assert {"gpu-node-0", "gpu-node-1", "gpu-node-2"} <= set(first)
    lease = cluster.kubectl_json("get", "lease", "gpu-node-0", "-n", "kube-node-lease")
    assert lease["spec"]["leaseDurationSeconds"] == 40
    # Every lease is renewed again within two renew intervals (10 s each, jitter 4 %).
    cluster.wait_for(lambda: all(age < 25 for age in renewed().values()) or None, timeout=60,
                     what="every fake node's Lease renewed within 25 s")


def test_pods_scheduled_to_fake_nodes_become_running(cluster):
    ns = "e2e-scheduling"
    cluster.kubectl("create", "namespace", ns, check=False)
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpu-consumer", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/none:1",
                                  "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "nodeSelector": {"nvidia.com/gpu.present": "true"}},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        def running():
            p = cluster.kubectl_json("get", "pod", "gpu-consumer", "-n", ns)
            return p["status"].get("phase") == "Running" and p["spec"].get("nodeName")
        node = cluster.wait_for(running, timeout=60, what="pod Running on a fake GPU node")
        assert node.startswith("gpu-node-")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_server_reports_the_pinned_kubernetes_version(cluster):
    from zerolayer.cluster import versions
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == versions.KUBERNETES
    assert out["clientVersion"]["gitVersion"] == versions.KUBERNETES


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolayer.cli", *args], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300, env=env)


def test_up_twice_reuses_the_running_cluster(cluster):
    proc = _cli("cluster", "up")
    assert proc.returncode == 0, proc.stderr
    assert "reusing" in proc.stderr
    st = _cli("cluster", "status", "-o", "json")
    assert st.returncode == 0
    assert json.loads(st.stdout)["running"] is True


def test_kubeconfig_and_env_point_at_the_cluster_and_cached_tools(cluster):
    assert _cli("cluster", "kubeconfig").stdout.strip() == cluster.kubeconfig
    env_out = _cli("cluster", "env").stdout
    assert f"export KUBECONFIG={cluster.kubeconfig}" in env_out
    assert str(cluster.bin_dir) in env_out
    for tool in ("kubectl", "helm"):
        assert os.access(cluster.bin_dir / tool, os.X_OK)


def _process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except FileNotFoundError:
        return False


def test_a_second_cluster_comes_up_and_down_leaving_no_process(tmp_path):
    """A separate state directory gives an independent cluster; `down` leaves nothing behind."""
    env = dict(os.environ, ZEROLAYER_STATE=str(tmp_path))
    up = _cli("cluster", "up", "--nodes", "1", env=env)
    assert up.returncode == 0, up.stderr
    local = LocalCluster(state_dir=tmp_path, log=lambda m: None)
    pids = [c.pid for c in local.components()]
    assert len(pids) == 5 and all(c.alive for c in local.components())
    down = _cli("cluster", "down", env=env)
    assert down.returncode == 0, down.stderr
    for pid in pids:
        assert not _process_exists(pid), f"pid {pid} survived `cluster down`"
    assert not (tmp_path / "cluster").exists()
    again = _cli("cluster", "down", env=env)
    assert again.returncode == 0 and "no local cluster" in again.stderr


def test_up_refuses_a_half_dead_cluster_with_a_clear_message(tmp_path):
    env = dict(os.environ, ZEROLAYER_STATE=str(tmp_path))
    assert _cli("cluster", "up", "--nodes", "1", env=env).returncode == 0
    local = LocalCluster(state_dir=tmp_path, log=lambda m: None)
    try:
        sched = next(c for c in local.components() if c.name == "kube-scheduler")
        os.killpg(sched.pid, 9)
        for _ in range(50):
            if not sched.alive:
                break
            time.sleep(0.1)
        again = _cli("cluster", "up", env=env)
        assert again.returncode == 1
        assert "not healthy" in again.stderr and "kube-scheduler" in again.stderr and "down" in again.stderr
    finally:
        assert _cli("cluster", "down", env=env).returncode == 0
