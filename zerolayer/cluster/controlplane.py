"""The local control plane's components and their flags: pure builders, no processes.

:meth:`zerolayer.cluster.local.LocalCluster.up` starts them in :data:`ORDER` with these arguments;
``tests/unit/test_cluster_builders.py`` reads them with no cluster.
"""

from __future__ import annotations

import dataclasses
import pathlib

SERVICE_CIDR = "10.96.0.0/16"
# The ports each start picks afresh, by the name the components know them under.
PORTS = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")


@dataclasses.dataclass(frozen=True)
class Plane:
    """Where one control plane lives: its directory, its PKI, the address the API server binds to
    (127.0.0.1, or the node bridge when real nodes join) and its ports by :data:`PORTS` name."""

    dir: pathlib.Path
    address: str
    ports: dict[str, int]
    real_nodes: bool = False

    @property
    def pki(self) -> pathlib.Path:
        return self.dir / "pki"

    @property
    def api_url(self) -> str:
        return f"https://{self.address}:{self.ports['apiserver']}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['etcd']}"


def etcd_args(plane: Plane) -> list[str]:
    client, peer = plane.etcd_url, f"http://127.0.0.1:{plane.ports['etcd-peer']}"
    return ["--name=zerolayer", f"--data-dir={plane.dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=zerolayer={peer}", "--unsafe-no-fsync",
            "--log-level=warn", "--quota-backend-bytes=4294967296"]


def apiserver_args(plane: Plane) -> list[str]:
    p, address = plane.pki, plane.address
    if plane.real_nodes:
        # Pods reach the API server on the bridge, directly or through the `kubernetes` Service
        # (whose endpoint is the advertised address); it reaches kubelets by InternalIP.
        node_flags = [f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                      f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                      f"--kubelet-certificate-authority={p / 'ca.crt'}",
                      "--kubelet-preferred-address-types=InternalIP"]
    else:
        # 127.0.0.1 is not a valid endpoint address, so the `kubernetes` Service gets none.
        node_flags = ["--endpoint-reconciler-type=none"]
    return [f"--etcd-servers={plane.etcd_url}", f"--bind-address={address}", f"--advertise-address={address}",
            f"--secure-port={plane.ports['apiserver']}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            *node_flags, "--profiling=false", "--v=1"]


def _client_flags(plane: Plane, user: str, port: str) -> list[str]:
    """A controller's kubeconfig (for its work, authentication and authorization) and its own port."""
    config = plane.dir / f"{user}.kubeconfig"
    return [f"--kubeconfig={config}", f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}", "--bind-address=127.0.0.1",
            f"--secure-port={plane.ports[port]}", "--leader-elect=false", "--profiling=false", "--v=1"]


def controller_manager_args(plane: Plane) -> list[str]:
    p = plane.pki
    return [*_client_flags(plane, "controller-manager", "controller-manager"),
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The defaults (20 requests/s per controller, 2 DaemonSet workers) are sized for small
            # clusters: with one DaemonSet per node at 1,000 kwok nodes the DaemonSet controller
            # waited on its own client-side rate limiter for most of each sync and fell minutes
            # behind (docs/fleet-scale.md). Large clusters raise them the same way.
            "--kube-api-qps=200", "--kube-api-burst=400", "--concurrent-daemonset-syncs=8"]


def scheduler_args(plane: Plane) -> list[str]:
    return _client_flags(plane, "scheduler", "scheduler")


def kwok_args(plane: Plane, kubeconfig: pathlib.Path, stages: pathlib.Path) -> list[str]:
    return [f"--kubeconfig={kubeconfig}", f"--config={stages}", "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1", f"--server-address=127.0.0.1:{plane.ports['kwok']}"]
