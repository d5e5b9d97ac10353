"""A local cluster with one real node, for e2e tests whose pods must really run.

The cluster lives in its own state directory (never the developer's default one) and is brought
up lazily: :meth:`RealCluster.ensure_up` starts it when it is not running, so a test that takes it
down (to check the teardown) does not break tests that run after it. Helpers here create only
pods on the real node and send traffic only to the pod addresses those pods got.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

from zerolayer.cluster import host, images, node
from zerolayer.cluster.local import LocalCluster

from tests.conftest import REPO
from tests.e2e.conftest import E2ECluster

REAL_NODE = f"{node.REAL_NODE_PREFIX}0"
BUSYBOX = images.BUSYBOX_IMAGE


class RealCluster(E2ECluster):
    """An :class:`E2ECluster` whose ``local`` runs one real node, ``real-node-0``."""

    def __init__(self, local: LocalCluster, log=print):
        self.local = local
        self.log = log
        self.kubeconfig = str(local.kubeconfig)
        self.started_here = False

    @property
    def bin_dir(self) -> pathlib.Path:  # resolved lazily: the toolchain may be built by the first up
        return self.local.toolchain.bin_dir

    def ensure_up(self, timeout: float = 300) -> None:
        """Bring the cluster up (0 kwok nodes, 1 real node) unless it is already running; apply the CRDs."""
        if self.local.is_running():
            return
        self.local.down(quiet=True)  # a half-dead earlier one
        started = time.monotonic()
        self.local.up(nodes=0, real_nodes=1, timeout=timeout)
        self.started_here = True
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        self.wait_established("inferencenodes.zerolayer.io", "tenantquotas.zerolayer.io")
        self.log(f"[real-cluster] up with {REAL_NODE} in {time.monotonic() - started:.1f}s")

    # ------------------------------------------------------------------ pods
    def busybox_pod(self, name: str, namespace: str, command: str, labels: dict[str, str] | None = None) -> dict:
        """A pod on the real node running ``sh -c command`` in the locally imported busybox image."""
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": {
                "nodeName": REAL_NODE,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "IfNotPresent",
                                "command": ["sh", "-c", command]}],
            },
        }

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))

    def wait_running(self, namespace: str, *names: str, timeout: float = 90) -> dict[str, str]:
        """Wait until every named pod is Ready; returns name -> pod IP."""
        def ready():
            out = self.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False)
            if out.returncode != 0:
                return None
            pods = {p["metadata"]["name"]: p for p in json.loads(out.stdout)["items"]}
            ips = {}
            for name in names:
                pod = pods.get(name)
                conds = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
                if not pod or conds.get("Ready") != "True" or not pod["status"].get("podIP"):
                    return None
                ips[name] = pod["status"]["podIP"]
            return ips
        return self.wait_for(ready, timeout=timeout, interval=0.5, what=f"pods {names} Ready in {namespace}")

    def exec(self, namespace: str, pod: str, *cmd: str, timeout: float = 30):
        return self.kubectl("exec", "-n", namespace, pod, "--", *cmd, check=False, timeout=timeout)


def host_leftovers(cluster_dir: pathlib.Path) -> dict[str, list]:
    """What a taken-down real-node cluster could have left on the host; every list empty when clean."""
    bridge = subprocess.run(["ip", "link", "show", host.BRIDGE], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode == 0
    chains = [f"{t}/{c}" for tool in ("iptables", "ip6tables") for t, cs in host.chains(tool).items() for c in cs]
    ipsets = subprocess.run(["ipset", "list", "-n"], stdout=subprocess.PIPE, text=True).stdout.split()
    netns = sorted(p.name for p in pathlib.Path("/run/netns").glob("cni-*")) if pathlib.Path("/run/netns").is_dir() \
        else []
    mounts = [line.split()[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
              if str(cluster_dir) in line.split()[4] or "/run/containerd" in line.split()[4]
              or "/var/lib/kubelet" in line.split()[4]]
    cgroups = [str(p) for p in pathlib.Path("/sys/fs/cgroup").glob(f"*/{host.CGROUP_PARENT}")]
    return {
        "processes": host.processes_mentioning(str(cluster_dir)),
        "bridge": [host.BRIDGE] if bridge else [],
        "chains": chains,
        "ipsets": [s for s in ipsets if s.startswith(host.IPSET_PREFIXES)],
        "netns": netns,
        "mounts": mounts,
        "cgroups": cgroups,
        "claim": [str(host.CLAIM)] if host.CLAIM.exists() else [],
        "state_dir": [str(cluster_dir)] if cluster_dir.exists() else [],
    }
