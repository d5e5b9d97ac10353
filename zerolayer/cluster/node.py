"""Real nodes for the local control plane: pods that run for real, on this host.

``LocalCluster.up(real_nodes=N)`` calls in here. Each real node ``real-node-<i>`` is a kubelet with
its own containerd (runc, overlayfs, bridge CNI); the host gets one kube-proxy (iptables mode, so
the ``kubernetes`` Service works from pods) and one kube-router (firewall only: it enforces
NetworkPolicies). Everything shares the host's root network namespace:

- bridge ``zl-br0``: ``10.233.0.1/16`` is the pods' gateway and the API server's address,
  ``10.233.0.2/16`` every real node's InternalIP; node ``i``'s pods get ``10.233.<i+1>.2-254``
  (its ``spec.podCIDR`` is ``10.233.<i+1>.0/24``). All pods sit in one L2 subnet, so nothing here
  turns on IP forwarding.
- Why one node IP for all nodes: kube-router enforces policies for pods whose ``hostIP`` is its
  node's IP. Sharing the IP lets one kube-router (and one kube-proxy) serve every node; two
  instances in one network namespace would fight over the same chains. Kubelets differ by port.

Contract of the builders (pure, unit-tested): each returns the exact config a component reads.
The lifecycle functions need root and are called with the cluster's ``launch`` callback, which
starts and records a process so ``down`` can stop it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import time

from zerolayer.cluster import build, host, images, pki

REAL_NODE_PREFIX = "real-node-"
REAL_NODE_LABEL = "zerolayer.io/real-node"
POD_NETWORK = host.NETWORK
CNI_BIN_DIR = "/usr/lib/cni"
GPUS_PER_REAL_NODE = 1  # advertised only: there is no GPU behind it here
EXTENDED_RESOURCE = "nvidia.com/gpu"


class NodeError(RuntimeError):
    """A real node could not be started."""


@dataclasses.dataclass(frozen=True)
class RealNode:
    """One real node's identity and paths (all below the cluster's state directory)."""

    index: int
    dir: pathlib.Path
    kubelet_port: int
    healthz_port: int

    @property
    def name(self) -> str:
        return f"{REAL_NODE_PREFIX}{self.index}"

    @property
    def socket(self) -> pathlib.Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def pod_cidr(self) -> str:
        return f"10.233.{self.index + 1}.0/24"

    @property
    def kubelet_root(self) -> pathlib.Path:
        return self.dir / "kubelet"

    def as_dict(self) -> dict:
        return {"name": self.name, "index": self.index, "dir": str(self.dir), "socket": str(self.socket),
                "kubelet_port": self.kubelet_port, "healthz_port": self.healthz_port, "pod_cidr": self.pod_cidr,
                "node_ip": host.NODE_IP}

    @classmethod
    def from_dict(cls, d: dict) -> RealNode:
        return cls(d["index"], pathlib.Path(d["dir"]), d["kubelet_port"], d["healthz_port"])


# ---------------------------------------------------------------- builders
def containerd_config(node: RealNode, cni_conf_dir: pathlib.Path) -> str:
    """containerd 1.6 config (TOML, version 2) with every path under the node's directory.

    ``restrict_oom_score_adj``: this host's root lacks CAP_SYS_RESOURCE, and without it every
    sandbox fails to start. The sandbox image is the locally built pause (no registry here).
    ``netns_mounts_under_state_dir``: each pod's network namespace is a bind mount under the node's
    state directory, not in the host's ``/run/netns``, so teardown finds every one by its path,
    including those whose pause process had already exited when the node stopped.
    """
    d = node.dir / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"

[grpc]
  address = "{node.socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"

[{cri}]
  sandbox_image = "{images.PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{d / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{cni_conf_dir}"
  max_conf_num = 1
"""


def cni_conflist(node: RealNode) -> dict:
    """Bridge CNI on ``zl-br0``: one /16 shared by all real nodes, this node's range a /24 of it.

    ``isGateway`` is off because the host owns the bridge's addresses (two of them, which the
    bridge plugin would refuse); pods still route through ``10.233.0.1``. No IP masquerade (pods
    talk only to the host and each other). IPAM state stays under the node's directory.
    """
    third = node.index + 1
    return {
        "cniVersion": "0.4.0",
        "name": "zerolayer",
        "plugins": [
            {
                "type": "bridge",
                "bridge": host.BRIDGE,
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(node.dir / "cni" / "ipam"),
                    "ranges": [[{"subnet": POD_NETWORK, "rangeStart": f"10.233.{third}.2",
                                 "rangeEnd": f"10.233.{third}.254", "gateway": host.GATEWAY_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def node_labels(node: RealNode) -> dict[str, str]:
    """GPU-feature-discovery-style labels (as on the kwok nodes) plus a marker for real nodes."""
    # Imported here: local.py imports this module, and the GPU identity is defined once, there.
    from zerolayer.cluster.local import GPU_MEMORY_MIB, GPU_PRODUCT

    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": GPU_PRODUCT,
        "nvidia.com/gpu.memory": str(GPU_MEMORY_MIB),
        "nvidia.com/gpu.count": str(GPUS_PER_REAL_NODE),
        REAL_NODE_LABEL: "true",
    }


def kubelet_config(node: RealNode, pki_dir: pathlib.Path, cgroup_root: str) -> dict:
    """KubeletConfiguration for this host (cgroup v1, no swap limits, no CAP_SYS_RESOURCE, no DNS).

    ``failCgroupV1: false``: 1.35 refuses cgroup v1 otherwise. ``resolvConf`` points at a file that
    names loopback only, so pods never query the host's resolvers. Image GC is off (images here are
    imported, never pulled) and eviction thresholds are low so a busy shared machine does not evict.
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": host.NODE_IP,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": node.healthz_port,
        "tlsCertFile": str(pki_dir / f"{node.name}-serving.crt"),
        "tlsPrivateKeyFile": str(pki_dir / f"{node.name}-serving.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki_dir / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "oomScoreAdj": 0,
        "resolvConf": str(node.dir / "resolv.conf"),
        "podLogsDir": str(node.dir / "pod-logs"),
        "clusterDomain": "cluster.local",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "10s",
        "staticPodPath": "",
    }


def kube_proxy_config(kubeconfig: pathlib.Path, healthz_port: int, metrics_port: int) -> dict:
    """kube-proxy in iptables mode for the pod network; leaves the host's conntrack sysctls alone
    (setting them needs CAP_SYS_RESOURCE) and serves NodePorts only on the node address."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "hostnameOverride": f"{REAL_NODE_PREFIX}0",
        "clusterCIDR": POD_NETWORK,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "nodePortAddresses": [f"{host.NODE_IP}/32"],
        # kube-router rewrites the filter table too; a sync that collides with it is retried after
        # syncPeriod, so keep that short (the rule set here is tiny).
        "iptables": {"localhostNodePorts": False, "masqueradeAll": False, "syncPeriod": "10s",
                     "minSyncPeriod": "1s"},
        "oomScoreAdj": 0,
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def kube_router_args(kubeconfig: pathlib.Path, service_cidr: str) -> list[str]:
    """kube-router as a NetworkPolicy enforcer only (no routing, no service proxy, no CNI)."""
    return [
        f"--kubeconfig={kubeconfig}", f"--hostname-override={REAL_NODE_PREFIX}0",
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
        f"--service-cluster-ip-range={service_cidr}", "--health-port=0", "--metrics-port=0",
        "--enable-ipv6=false", "--v=1",
    ]


def kubelet_args(node: RealNode) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in node_labels(node).items())
    return [
        f"--config={node.dir / 'kubelet.yaml'}", f"--kubeconfig={node.dir / 'kubeconfig'}",
        f"--hostname-override={node.name}", f"--node-ip={host.NODE_IP}", f"--node-labels={labels}",
        f"--root-dir={node.kubelet_root}", "--v=1",
    ]


def capacity_patch(gpus: int = GPUS_PER_REAL_NODE) -> dict:
    """The documented node-status patch that advertises an extended resource. Allocatable is set
    too so the node is schedulable at once (the kubelet keeps allocatable = capacity afterwards)."""
    return {"status": {"capacity": {EXTENDED_RESOURCE: str(gpus)}, "allocatable": {EXTENDED_RESOURCE: str(gpus)}}}


# ---------------------------------------------------------------- setup (scripts/setup.sh)
def ensure_node_host(log=print) -> build.NodeToolchain:
    """Everything real nodes need on this machine, idempotent: Debian packages (as root), the
    kubelet/kube-proxy/kube-router build, and the pause and busybox image archives."""
    host.ensure_packages(log)
    tc = build.ensure_node_binaries()
    images.pause_image(log)
    images.busybox_image(log)
    return tc


# ---------------------------------------------------------------- lifecycle
def _write(path: pathlib.Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _wait(check, timeout: float, what: str, alive=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        if check():
            return
        time.sleep(0.25)
    raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}")


def containerd_ready(node: RealNode) -> bool:
    return subprocess.run(["ctr", "--address", str(node.socket), "version"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=10).returncode == 0


def start_node(node: RealNode, *, launch, api_url: str, pki_dir: pathlib.Path, tc: build.NodeToolchain,
               alive, log) -> None:
    """Start one node's containerd, import the sandbox and busybox images, then start its kubelet."""
    cni_dir = node.dir / "cni" / "net.d"
    _write(cni_dir / "10-zerolayer.conflist", json.dumps(cni_conflist(node), indent=2))
    _write(node.dir / "containerd" / "config.toml", containerd_config(node, cni_dir))
    launch(f"containerd-{node.name}", "/usr/bin/containerd",
           [f"--config={node.dir / 'containerd' / 'config.toml'}", "--log-level=warn"], 0)
    _wait(lambda: containerd_ready(node), 30, f"{node.name}'s containerd", alive)
    for archive in (images.pause_image(log), images.busybox_image(log)):
        images.import_image(node.socket, archive)

    pki.create_node(pki_dir, node.name, host.NODE_IP)
    _write(node.dir / "kubeconfig", pki.kubeconfig(api_url, pki_dir, node.name), 0o600)
    _write(node.dir / "resolv.conf", "nameserver 127.0.0.1\n")
    cgroup_root = host.make_cgroup_root(node.name)
    _write(node.dir / "kubelet.yaml", json.dumps(kubelet_config(node, pki_dir, cgroup_root), indent=2))
    node.kubelet_root.mkdir(parents=True, exist_ok=True)
    launch(f"kubelet-{node.name}", str(tc.path("kubelet")), kubelet_args(node), node.kubelet_port)


def register_node(node: RealNode, kubectl) -> None:
    """After the kubelet registered the Node: set its pod CIDR (once) and advertise the GPUs."""
    current = json.loads(kubectl("get", "node", node.name, "-o", "json").stdout)
    if not current["spec"].get("podCIDR"):
        kubectl("patch", "node", node.name, "--type=merge",
                "-p", json.dumps({"spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr]}}))
    kubectl("patch", "node", node.name, "--subresource=status", "--type=merge", "-p", json.dumps(capacity_patch()))


def start_host_agents(*, launch, cluster_dir: pathlib.Path, kubeconfig: pathlib.Path, service_cidr: str,
                      tc: build.NodeToolchain, ports: tuple[int, int], wait) -> None:
    """One kube-proxy and one kube-router for every real node on this host (see the module doc).

    One after the other, each waited for until it has programmed iptables: two first syncs at
    once collide in iptables-restore, and kube-proxy then retries only after 30 s.
    ``wait(check, timeout, what)`` raises when ``check`` stays false.
    """
    cfg = cluster_dir / "kube-proxy.yaml"
    _write(cfg, json.dumps(kube_proxy_config(kubeconfig, *ports), indent=2))
    launch("kube-proxy", str(tc.path("kube-proxy")), [f"--config={cfg}", "--v=1"], ports[0])
    wait(service_rules_synced, 60, "kube-proxy to program the kubernetes Service")
    launch("kube-router", str(tc.path("kube-router")), kube_router_args(kubeconfig, service_cidr), 0)
    wait(firewall_synced, 60, "kube-router to install its firewall chains")


def _iptables_rules(table: str, chain: str) -> str:
    return subprocess.run(["iptables", "-t", table, "-S", chain], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True).stdout


def service_rules_synced() -> bool:
    """kube-proxy has programmed the ``kubernetes`` Service: until then a pod's dial of 10.96.0.1 hangs."""
    return "-d 10.96.0.1/32" in _iptables_rules("nat", "KUBE-SERVICES")


def firewall_synced() -> bool:
    """kube-router's chains are hooked in: until then pod traffic passes unfiltered."""
    return "KUBE-ROUTER-FORWARD" in _iptables_rules("filter", "FORWARD")


def teardown(cluster_dir: pathlib.Path, nodes: list[RealNode], log) -> None:
    """After the cluster's processes are stopped: kill the pods (shims and below), unmount, remove
    their network namespaces and cgroups, then release the host (bridge, chains, ipsets, paths).
    Touches no other containerd's pods or mounts: only those that name this cluster's paths."""
    netns: set[int] = set()
    for node in nodes:
        netns |= host.kill_pods(str(node.socket))
    # The shims also name the node's state directory; a shim whose socket line differs still does.
    netns |= host.kill_pods(str(cluster_dir / "nodes"))
    # Only a cluster made before netns_mounts_under_state_dir has its pods' namespaces in /run/netns;
    # today's are mounts below cluster_dir, which the unmount below removes.
    host.remove_netns(netns)
    # Every mount a node makes (overlay rootfs, volumes, the sandbox's shm) is below its directory.
    host.unmount_under([str(cluster_dir)])
    for node in nodes:
        host.remove_cgroups(node.name)
    host.release(cluster_dir, log)
