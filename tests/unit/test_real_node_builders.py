"""Pure parts of real nodes: component configs, node certificates, image archives, iptables parsing."""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import pathlib
import tarfile

from cryptography import x509

from zerolayer import cli
from zerolayer.cluster import build, host, images, node, pki, versions


def _node(tmp_path: pathlib.Path, index: int = 0) -> node.RealNode:
    return node.RealNode(index, tmp_path / f"real-node-{index}", 40000 + index, 41000 + index)


def test_each_node_has_its_own_range_inside_the_shared_pod_network(tmp_path):
    net = ipaddress.ip_network(node.POD_NETWORK)
    ranges = []
    for i in range(3):
        n = _node(tmp_path, i)
        ipam = node.cni_conflist(n)["plugins"][0]["ipam"]
        (r,) = ipam["ranges"][0]
        assert ipaddress.ip_address(r["rangeStart"]) in ipaddress.ip_network(n.pod_cidr)
        assert ipaddress.ip_address(r["rangeEnd"]) in ipaddress.ip_network(n.pod_cidr)
        assert ipaddress.ip_network(n.pod_cidr).subnet_of(net) and r["subnet"] == node.POD_NETWORK
        assert r["gateway"] == host.GATEWAY_IP and ipam["dataDir"].startswith(str(n.dir))
        ranges.append(n.pod_cidr)
    assert len(set(ranges)) == 3
    # The gateway and the node address are ours and outside every node's pod range.
    for ip in (host.GATEWAY_IP, host.NODE_IP):
        assert ipaddress.ip_address(ip) in net
        assert not any(ipaddress.ip_address(ip) in ipaddress.ip_network(r) for r in ranges)


def test_cni_leaves_the_bridge_addresses_and_forwarding_to_the_host(tmp_path):
    bridge = node.cni_conflist(_node(tmp_path))["plugins"][0]
    assert bridge["bridge"] == host.BRIDGE
    assert bridge["isGateway"] is False and bridge["ipMasq"] is False


def test_containerd_config_keeps_every_path_under_the_node_dir(tmp_path):
    n = _node(tmp_path)
    text = node.containerd_config(n, n.dir / "cni" / "net.d")
    assert f'address = "{n.socket}"' in text
    assert "restrict_oom_score_adj = true" in text and "SystemdCgroup = false" in text
    assert "netns_mounts_under_state_dir = true" in text  # the pods' network namespaces too
    assert 'snapshotter = "overlayfs"' in text
    assert f'sandbox_image = "{images.PAUSE_IMAGE}"' in text
    for line in text.splitlines():
        if line.strip().startswith(("root", "state", "path", "Root", "conf_dir")):
            assert str(n.dir) in line, line


def test_kubelet_config_for_this_kind_of_host(tmp_path):
    n = _node(tmp_path)
    cfg = node.kubelet_config(n, tmp_path / "pki", "/zerolayer/real-node-0")
    assert cfg["failCgroupV1"] is False and cfg["failSwapOn"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["address"] == host.NODE_IP and cfg["port"] == n.kubelet_port
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["authorization"]["mode"] == "Webhook"
    assert cfg["containerRuntimeEndpoint"] == f"unix://{n.socket}"
    assert cfg["tlsCertFile"].endswith("real-node-0-serving.crt")
    assert cfg["cgroupRoot"] == "/zerolayer/real-node-0"


def test_kubelet_args_carry_gpu_feature_discovery_labels(tmp_path):
    args = node.kubelet_args(_node(tmp_path))
    labels = dict(kv.split("=", 1) for kv in
                  next(a for a in args if a.startswith("--node-labels=")).split("=", 1)[1].split(","))
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.count"] == str(node.GPUS_PER_REAL_NODE)
    assert labels[node.REAL_NODE_LABEL] == "true"
    assert f"--node-ip={host.NODE_IP}" in args


def test_capacity_patch_is_the_documented_status_patch():
    patch = node.capacity_patch(2)
    assert patch == {"status": {"capacity": {"nvidia.com/gpu": "2"}, "allocatable": {"nvidia.com/gpu": "2"}}}


def test_kube_proxy_and_kube_router_stay_on_our_addresses(tmp_path):
    cfg = node.kube_proxy_config(tmp_path / "kc", 1, 2)
    assert cfg["mode"] == "iptables" and cfg["clusterCIDR"] == node.POD_NETWORK
    assert cfg["nodePortAddresses"] == [f"{host.NODE_IP}/32"]
    assert cfg["healthzBindAddress"].startswith("127.0.0.1:")
    assert cfg["conntrack"]["maxPerCore"] == 0
    args = node.kube_router_args(tmp_path / "kc", "10.96.0.0/16")
    for flag in ("--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false"):
        assert flag in args


def test_node_certificates_are_signed_by_the_cluster_ca(tmp_path):
    pki.create(tmp_path, extra_ips=(host.GATEWAY_IP,))
    pki.create_node(tmp_path, "real-node-0", host.NODE_IP)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    client = x509.load_pem_x509_certificate((tmp_path / "real-node-0.crt").read_bytes())
    serving = x509.load_pem_x509_certificate((tmp_path / "real-node-0-serving.crt").read_bytes())
    for cert in (client, serving):
        cert.verify_directly_issued_by(ca)
    assert client.subject.rfc4514_string() == "O=system:nodes,CN=system:node:real-node-0"
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(i) for i in sans.get_values_for_type(x509.IPAddress)] == [host.NODE_IP]
    api = x509.load_pem_x509_certificate((tmp_path / "apiserver.crt").read_bytes())
    api_ips = api.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert host.GATEWAY_IP in [str(i) for i in api_ips.get_values_for_type(x509.IPAddress)]
    kubelet_client = x509.load_pem_x509_certificate((tmp_path / "apiserver-kubelet-client.crt").read_bytes())
    assert "O=system:masters" in kubelet_client.subject.rfc4514_string()


def test_oci_archive_is_reproducible_and_names_the_image(tmp_path):
    layer = images.layer_tar({"bin/tool": b"#!/bin/sh\n"}, symlinks={"bin/sh": "tool"}, dirs={"tmp": 0o1777})
    assert layer == images.layer_tar({"bin/tool": b"#!/bin/sh\n"}, symlinks={"bin/sh": "tool"}, dirs={"tmp": 0o1777})
    a = images.write_oci_archive(tmp_path / "a.tar", "zerolayer.local/x:1", layer, {"Cmd": ["sh"]})
    b = images.write_oci_archive(tmp_path / "b.tar", "zerolayer.local/x:1", layer, {"Cmd": ["sh"]})
    assert a.read_bytes() == b.read_bytes()
    with tarfile.open(a) as tar:
        index = json.load(tar.extractfile("index.json"))
        (desc,) = index["manifests"]
        assert desc["annotations"]["io.containerd.image.name"] == "zerolayer.local/x:1"
        manifest_bytes = tar.extractfile(f"blobs/sha256/{desc['digest'].split(':')[1]}").read()
        assert hashlib.sha256(manifest_bytes).hexdigest() == desc["digest"].split(":")[1]
        manifest = json.loads(manifest_bytes)
        assert manifest["layers"][0]["digest"] == "sha256:" + hashlib.sha256(layer).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "tool"
    assert members["tmp"].mode == 0o1777 and members["bin"].isdir()


def test_chain_cleanup_deletes_only_rules_that_jump_to_our_chains():
    ours = {"KUBE-ROUTER-INPUT"}
    assert host._jumps_to(["-A", "INPUT", "-m", "comment", "--comment", "kube-router netpol", "-j",
                           "KUBE-ROUTER-INPUT"], ours)
    assert not host._jumps_to(["-A", "INPUT", "-j", "ACCEPT"], ours)


def test_node_binaries_have_their_own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROLAYER_CACHE", str(tmp_path))
    assert build.node_toolchain_dir() == tmp_path / f"node-{versions.NODE_STAMP}" / "bin"
    assert build.node_toolchain_dir().parent != build.toolchain_dir().parent
    assert build.NodeToolchain(build.node_toolchain_dir()).missing == list(versions.NODE_BINARIES)
    assert versions.ldflags("kube-router").endswith(f"Version={versions.KUBE_ROUTER}")
    assert f"gitVersion={versions.KUBERNETES}" in versions.ldflags("kubelet")


def test_up_accepts_real_nodes():
    args = cli.build_parser().parse_args(["cluster", "up", "--real-nodes", "2"])
    assert args.real_nodes == 2
    assert cli.build_parser().parse_args(["cluster", "up"]).real_nodes == 0


def test_a_running_kwok_cluster_asked_for_a_real_node_says_what_to_run():
    """Issue 25: the real-node quick start run after the kwok one reused the kwok cluster and stopped
    later with "this cluster has no real nodes"; now `up` refuses at once and names the commands."""
    from zerolayer.cluster.local import reuse_refusal

    message = reuse_refusal(1, 0)
    assert message and "zerolayer cluster down" in message and "--real-nodes 1" in message
    assert reuse_refusal(0, 0) is None and reuse_refusal(1, 1) is None and reuse_refusal(0, 1) is None
