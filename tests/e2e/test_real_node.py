"""A real node in the local control plane: pods run, reach the API server, log, and obey NetworkPolicies.

Runs against ``real_cluster`` (one kubelet + containerd node, ``real-node-0``, kube-proxy and
kube-router on this host; see docs/local-cluster.md). Traffic goes only to the API server's
address on our bridge and to the pods these tests create. Every wait is bounded and polls.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from zerolayer.cluster import host, node, versions

from tests.e2e.real_node_harness import REAL_NODE, host_leftovers


@pytest.fixture
def ns(real_cluster):
    name = f"zl-real-{uuid.uuid4().hex[:8]}"
    real_cluster.kubectl("create", "namespace", name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_real_node_is_a_ready_gpu_node(real_cluster):
    n = real_cluster.kubectl_json("get", "node", REAL_NODE)
    conds = {c["type"]: c["status"] for c in n["status"]["conditions"]}
    assert conds["Ready"] == "True"
    assert n["status"]["capacity"]["nvidia.com/gpu"] == str(node.GPUS_PER_REAL_NODE)
    assert n["status"]["allocatable"]["nvidia.com/gpu"] == str(node.GPUS_PER_REAL_NODE)
    labels = n["metadata"]["labels"]
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.product"] and labels["nvidia.com/gpu.count"] == str(node.GPUS_PER_REAL_NODE)
    assert labels[node.REAL_NODE_LABEL] == "true"
    addresses = {a["type"]: a["address"] for a in n["status"]["addresses"]}
    assert addresses["InternalIP"] == host.NODE_IP
    assert n["spec"]["podCIDR"] == "10.233.1.0/24"
    assert n["status"]["nodeInfo"]["kubeletVersion"] == versions.KUBERNETES
    assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")


def test_pod_reaches_the_api_server_through_the_kubernetes_service(real_cluster, ns):
    # The pod dials the Service env (10.96.0.1:443), as an in-cluster client does. busybox has no usable
    # TLS client in this image (its static wget crashes), so the pod speaks plain HTTP to the TLS port:
    # the answer only Go's HTTPS server gives proves the packets reached the API server through
    # kube-proxy's DNAT.
    marker = "zerolayer-real-node-marker"
    real_cluster.apply(real_cluster.busybox_pod(
        "api-client", ns,
        f"echo {marker} $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT; "
        "until timeout 5 sh -c \"printf 'GET /version HTTP/1.0\\r\\n\\r\\n' "
        "| nc -w 3 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT\" | grep 'HTTPS server'; do sleep 1; done; "
        "echo done; sleep 3600"))
    real_cluster.wait_running(ns, "api-client")
    eps = real_cluster.kubectl_json("get", "endpointslices", "-n", "default",
                                    "-l", "kubernetes.io/service-name=kubernetes")
    assert [a for s in eps["items"] for e in s["endpoints"] for a in e["addresses"]] == [host.GATEWAY_IP]

    def logs():
        out = real_cluster.kubectl("logs", "-n", ns, "api-client", check=False)
        return out.stdout if out.returncode == 0 and "done" in out.stdout else None
    text = real_cluster.wait_for(logs, timeout=60, what="the pod to reach the API server through the Service")
    assert f"{marker} 10.96.0.1:443" in text
    assert "Client sent an HTTP request to an HTTPS server." in text
    # exec goes API server -> kubelet (InternalIP, client certificate) -> containerd's stream server.
    out = real_cluster.exec(ns, "api-client", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    assert out.returncode == 0 and out.stdout == ns, out.stderr


def _reach(real_cluster, ns: str, client: str, ip: str) -> bool:
    # nc, not busybox wget: the static wget crashes inside this minimal image.
    out = real_cluster.exec(ns, client, "timeout", "4", "sh", "-c",
                            f"printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} 8080")
    return out.returncode == 0 and out.stdout.startswith("HTTP/1.") and out.stdout.rstrip().endswith("hello")


def _wait_reach(real_cluster, ns, ip, expected: dict[str, bool], what: str) -> float:
    started = time.monotonic()
    real_cluster.wait_for(lambda: all(_reach(real_cluster, ns, c, ip) == want for c, want in expected.items()),
                          timeout=60, interval=0.5, what=what)
    return time.monotonic() - started


def test_network_policy_is_enforced_and_lifted(real_cluster, ns):
    real_cluster.apply(
        real_cluster.busybox_pod("server", ns, "echo hello > /tmp/index.html; exec httpd -f -p 8080 -h /tmp",
                                 {"app": "np-server"}),
        real_cluster.busybox_pod("allowed", ns, "sleep 3600", {"role": "allowed"}),
        real_cluster.busybox_pod("denied", ns, "sleep 3600", {"role": "denied"}),
    )
    ip = real_cluster.wait_running(ns, "server", "allowed", "denied")["server"]
    assert ip.startswith("10.233.1.")
    # containerd mounts the pods' network namespaces under the node's state directory (where down's
    # unmount finds them, even once their pause has exited), none in the host's /run/netns.
    running = host_leftovers(real_cluster.local.dir)
    assert running["netns"] == []
    assert sum("/io.containerd.grpc.v1.cri/netns/" in m for m in running["mounts"]) >= 3
    _wait_reach(real_cluster, ns, ip, {"allowed": True, "denied": True}, "both clients to reach the server")

    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "only-allowed", "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": "np-server"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "allowed"}}}],
                         "ports": [{"protocol": "TCP", "port": 8080}]}],
        },
    }
    real_cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
    enforced = _wait_reach(real_cluster, ns, ip, {"allowed": True, "denied": False},
                           "kube-router to refuse the denied client")
    real_cluster.kubectl("delete", "networkpolicy", "-n", ns, "only-allowed")
    lifted = _wait_reach(real_cluster, ns, ip, {"allowed": True, "denied": True},
                         "the denied client to get through once the policy is gone")
    print(f"NetworkPolicy enforced after {enforced:.1f}s, lifted after {lifted:.1f}s")


def test_down_leaves_the_host_clean(real_cluster):
    """Last in this file: takes the cluster down (a later test's ``real_cluster`` brings it up again)."""
    cluster_dir = real_cluster.local.dir
    assert host.claim_holder() == str(cluster_dir)
    real_cluster.local.down()
    left = host_leftovers(cluster_dir)
    assert {k: v for k, v in left.items() if v} == {}
