"""A real local Kubernetes control plane without Docker.

``LocalCluster.up()`` starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as local processes on 127.0.0.1 with free ports, creates
fake GPU nodes (kwok keeps them Ready and turns their pods Running), writes an
admin kubeconfig and returns once the nodes are Ready. ``down()`` stops every
process it started and removes the state directory. The processes outlive the
command that started them; ``state.json`` in the state directory records them.

Pods on kwok nodes are records, not processes: tests run the operator and
runtimes as local processes against this API server. ``up(real_nodes=N)`` adds
N nodes whose pods do run (kubelet + containerd, see :mod:`zerolayer.cluster.node`);
the API server then listens on the node bridge instead of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from zerolayer.cluster import build, host, images, node, pki, versions

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_MEMORY_MIB = 81559
GPUS_PER_NODE = 8
NODE_PREFIX = "gpu-node-"
SERVICE_CIDR = "10.96.0.0/16"


class ClusterError(RuntimeError):
    """The local control plane could not be started, reached or stopped."""


def state_root() -> pathlib.Path:
    """``ZEROLAYER_STATE`` overrides ``~/.local/state/zerolayer``."""
    env = os.environ.get("ZEROLAYER_STATE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".local" / "state"
    return base / "zerolayer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclasses.dataclass
class Component:
    name: str
    pid: int
    port: int

    @property
    def alive(self) -> bool:
        return _alive(self.pid)


class LocalCluster:
    """One local control plane, identified by its state directory."""

    def __init__(self, state_dir: pathlib.Path | None = None, log=print):
        self.dir = (state_dir or state_root()) / "cluster"
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.kubeconfig = self.dir / "kubeconfig"
        self.log = log
        self._toolchain: build.Toolchain | None = None
        # Popen objects of processes this instance started: kept so they are not garbage-collected
        # while running (a ResourceWarning) and so down() can reap them properly.
        self._children: dict[int, subprocess.Popen] = {}

    # ------------------------------------------------------------------ state
    @property
    def state_file(self) -> pathlib.Path:
        return self.dir / "state.json"

    def state(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise ClusterError(f"{self.state_file} is corrupt; run `zerolayer cluster down`") from exc

    def components(self) -> list[Component]:
        st = self.state() or {}
        return [Component(**c) for c in st.get("components", [])]

    @property
    def toolchain(self) -> build.Toolchain:
        if self._toolchain is None:
            st = self.state()
            tc = build.Toolchain(pathlib.Path(st["bin_dir"])) if st else build.Toolchain(build.toolchain_dir())
            self._toolchain = tc if not tc.missing else build.ensure_binaries(self.log)
        return self._toolchain

    def is_running(self) -> bool:
        comps = self.components()
        return bool(comps) and all(c.alive for c in comps) and self.healthy()

    def api_url(self) -> str | None:
        st = self.state()
        return st and st["api_server"]

    # ------------------------------------------------------------------ health
    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def healthy(self, path: str = "/readyz") -> bool:
        url = self.api_url()
        if not url:
            return False
        try:
            with urllib.request.urlopen(url + path, context=self._ssl(), timeout=3) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False

    # ------------------------------------------------------------------ kubectl
    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the cached kubectl against this cluster; raises ClusterError on failure when ``check``."""
        cmd = [str(self.toolchain.path("kubectl")), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=input, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    # ------------------------------------------------------------------ up
    def _launch(self, state: dict, name: str, exe: str, args: list[str], port: int) -> int:
        """Start ``exe`` in its own session, logging to ``logs/<name>.log``, and record it in state.json."""
        logf = open(self.logs / f"{name}.log", "ab")
        # containerd's shims look for runc, kube-router and kube-proxy for iptables/ipset, on PATH.
        env = dict(os.environ, PATH=os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin",
                                                     "/sbin"]))
        proc = subprocess.Popen([exe, *args], stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.dir, env=env)
        logf.close()
        self._children[proc.pid] = proc
        state["components"].append(dataclasses.asdict(Component(name, proc.pid, port)))
        self.state_file.write_text(json.dumps(state, indent=2))
        return proc.pid

    def up(self, nodes: int = 3, timeout: float = 180, real_nodes: int = 0) -> str:
        """Start the control plane (or reuse a running one); returns "started" or "reused".

        ``real_nodes`` > 0 adds that many real nodes (root only; one such cluster per host): see
        :mod:`zerolayer.cluster.node`. Raises ClusterError when a previous cluster is half-alive
        (some processes dead): the caller should run ``down`` first rather than get a silently
        broken cluster, and when the host cannot run real nodes (before changing anything).
        """
        if self.state() is not None:
            if self.is_running():
                self.log(f"cluster already running (API server {self.api_url()}); reusing it")
                return "reused"
            dead = [c.name for c in self.components() if not c.alive]
            raise ClusterError(
                f"a previous local cluster in {self.dir} is not healthy (stopped: {', '.join(dead) or 'none'}); "
                "run `zerolayer cluster down` and then `up` again"
            )
        started = time.monotonic()
        if real_nodes:
            reason = host.unsupported_reason()
            if reason:
                raise ClusterError(f"cannot run real nodes here: {reason}")
            holder = live_real_node_holder(self.log)
            if holder is not None and holder != str(self.dir):
                raise ClusterError(f"real nodes of another local cluster ({holder}) hold this host; "
                                   "take that one down first")
        tc = build.ensure_binaries(self.log)
        node_tc = build.ensure_node_binaries(self.log) if real_nodes else None
        self._toolchain = tc
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        address = host.GATEWAY_IP if real_nodes else "127.0.0.1"
        pki.create(self.pki, extra_ips=(host.GATEWAY_IP,) if real_nodes else ())
        ports = {n: _free_port() for n in ("etcd", "etcd-peer", "apiserver", "controller-manager",
                                            "scheduler", "kwok")}
        api = f"https://{address}:{ports['apiserver']}"
        state = {"api_server": api, "bin_dir": str(tc.bin_dir), "versions": versions.STAMP,
                 "kubeconfig": str(self.kubeconfig), "components": [], "real_nodes": []}
        for user in ("admin", "controller-manager", "scheduler"):
            path = self.kubeconfig if user == "admin" else self.dir / f"{user}.kubeconfig"
            path.write_text(pki.kubeconfig(api, self.pki, user))
            path.chmod(0o600)

        def launch(name: str, args: list[str], port_key: str) -> None:
            self._launch(state, name, str(tc.path(name)), args, ports[port_key])

        if real_nodes:
            self.state_file.write_text(json.dumps(state, indent=2))  # so `down` finds the host claim's owner
        try:
            if real_nodes:
                host.acquire(self.dir)
                host.setup_network()
            etcd_url = f"http://127.0.0.1:{ports['etcd']}"
            peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
            launch("etcd", [
                "--name=zerolayer", f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=zerolayer={peer_url}", "--unsafe-no-fsync",
                "--log-level=warn", "--quota-backend-bytes=4294967296",
            ], "etcd")
            self._wait(lambda: self._http_ok(f"{etcd_url}/health"), 30, "etcd")
            p = self.pki
            if real_nodes:
                # Pods reach the API server on the bridge, directly or through the `kubernetes`
                # Service (whose endpoint is the advertised address); it reaches kubelets by InternalIP.
                node_flags = [
                    f"--kubelet-client-certificate={self.pki / 'apiserver-kubelet-client.crt'}",
                    f"--kubelet-client-key={self.pki / 'apiserver-kubelet-client.key'}",
                    f"--kubelet-certificate-authority={self.pki / 'ca.crt'}",
                    "--kubelet-preferred-address-types=InternalIP",
                ]
            else:
                # 127.0.0.1 is not a valid endpoint address, so the `kubernetes` Service gets none.
                node_flags = ["--endpoint-reconciler-type=none"]
            launch("kube-apiserver", [
                f"--etcd-servers={etcd_url}", f"--bind-address={address}", f"--advertise-address={address}",
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC", "--allow-privileged=true",
                *node_flags,
                "--profiling=false", "--v=1",
            ], "apiserver")
            self._wait(self.healthy, 90, "kube-apiserver")
            launch("kube-controller-manager", [
                f"--kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['controller-manager']}",
                "--leader-elect=false", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false", "--v=1",
                # The defaults (20 requests/s per controller, 2 DaemonSet workers) are sized for small
                # clusters: with one DaemonSet per node at 1,000 kwok nodes the DaemonSet controller
                # waited on its own client-side rate limiter for most of each sync and fell minutes
                # behind (docs/fleet-scale.md). Large clusters raise them the same way.
                "--kube-api-qps=200", "--kube-api-burst=400", "--concurrent-daemonset-syncs=8",
            ], "controller-manager")
            launch("kube-scheduler", [
                f"--kubeconfig={self.dir / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
                "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
                "--leader-elect=false", "--profiling=false", "--v=1",
            ], "scheduler")
            launch("kwok", [
                f"--kubeconfig={self.kubeconfig}", f"--config={tc.kwok_stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{ports['kwok']}",
            ], "kwok")
            if nodes:
                self.add_nodes(range(nodes))
            if real_nodes:
                self._start_real_nodes(state, real_nodes, node_tc)
            deadline = started + timeout
            self._wait(lambda: self._nodes_ready(nodes + real_nodes), max(5.0, deadline - time.monotonic()),
                       "nodes Ready")
            self._wait(lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default",
                                            check=False).returncode == 0,
                       max(5.0, deadline - time.monotonic()), "default ServiceAccount")
        except BaseException:
            self.log("start failed; stopping what was started (logs kept in the error below)")
            tails = self._log_tails()
            self.down(quiet=True)
            if tails:
                self.log(tails)
            raise
        self.log(f"cluster up in {time.monotonic() - started:.1f}s: API server {api}, {nodes} fake GPU nodes, "
                 f"{real_nodes} real nodes; kubeconfig {self.kubeconfig}")
        return "started"

    def _start_real_nodes(self, state: dict, count: int, tc: build.NodeToolchain) -> None:
        """Start each real node's containerd and kubelet, then the host's kube-proxy and kube-router."""
        def alive() -> None:
            dead = [c.name for c in self.components() if not c.alive]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited while starting real nodes")

        def launch(name, exe, args, port):
            return self._launch(state, name, exe, args, port)

        real = [node.RealNode(i, self.dir / "nodes" / f"{node.REAL_NODE_PREFIX}{i}", _free_port(), _free_port())
                for i in range(count)]
        state["real_nodes"] = [n.as_dict() for n in real]
        self.state_file.write_text(json.dumps(state, indent=2))
        try:
            for n in real:
                node.start_node(n, launch=launch, api_url=state["api_server"], pki_dir=self.pki, tc=tc,
                                alive=alive, log=self.log)
            for n in real:
                self._wait(lambda n=n: self.kubectl("get", "node", n.name, check=False).returncode == 0, 60,
                           f"{n.name} to register")
                node.register_node(n, self.kubectl)
            node.start_host_agents(launch=launch, cluster_dir=self.dir, kubeconfig=self.kubeconfig,
                                   service_cidr=SERVICE_CIDR, tc=tc, ports=(_free_port(), _free_port()),
                                   wait=self._wait)
        except (node.NodeError, images.ImageError, host.HostError) as exc:
            raise ClusterError(str(exc)) from exc

    def real_nodes(self) -> list[node.RealNode]:
        return [node.RealNode.from_dict(d) for d in (self.state() or {}).get("real_nodes", [])]

    def import_image(self, archive: str | os.PathLike) -> list[str]:
        """Import an OCI or docker-archive tarball into every real node's containerd (namespace
        ``k8s.io``, where the kubelet finds it); returns the image names. Pods then use it with
        ``imagePullPolicy: IfNotPresent`` (or a non-``latest`` tag): there is no registry."""
        real = self.real_nodes()
        if not real:
            raise ClusterError("this cluster has no real nodes (`zerolayer cluster up --real-nodes 1`)")
        names: list[str] = []
        try:
            for n in real:
                names = images.import_image(n.socket, archive)
        except images.ImageError as exc:
            raise ClusterError(str(exc)) from exc
        return names

    def add_nodes(self, indices) -> list[str]:
        """Create (or update) kwok-managed fake GPU nodes ``gpu-node-<i>``; returns their names."""
        docs, names = [], []
        for i in indices:
            name = f"{NODE_PREFIX}{i}"
            names.append(name)
            docs.append(node_manifest(name))
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        return names

    def _nodes_ready(self, expected: int) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        items = json.loads(out.stdout)["items"]
        ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n.get("status", {}).get("conditions", []))]
        return len(ready) >= expected

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [c.name for c in self.components() if not c.alive]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited while waiting for {what}")
            if check():
                return
            time.sleep(0.25)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def _log_tails(self) -> str:
        parts = []
        for f in sorted(self.logs.glob("*.log")) if self.logs.exists() else []:
            lines = f.read_text(errors="replace").splitlines()[-6:]
            if lines:
                parts.append(f"--- {f.name} (last lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ down
    def down(self, quiet: bool = False) -> bool:
        """Stop every recorded process (TERM, then KILL after 10 s) and remove the state directory.

        Returns False when there was nothing to stop. Safe to call twice.
        """
        comps = self.components() if self.state_file.exists() else []
        for c in reversed(comps):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(c.alive for c in comps) and time.monotonic() < deadline:
            time.sleep(0.1)
        for c in comps:
            if c.alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.pid, signal.SIGKILL)
        # Reap our own children (when up() and down() run in one process) so no zombie stays.
        for c in comps:
            child = self._children.pop(c.pid, None)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=5)
        real = [node.RealNode.from_dict(d) for d in ((self.state() or {}) if self.state_file.exists() else {})
                .get("real_nodes", [])]
        if real or host.claim_holder() == str(self.dir):
            # Before removing the directory: pod mounts below it must be gone first.
            node.teardown(self.dir, real, self.log)
        existed = self.dir.exists()
        shutil.rmtree(self.dir, ignore_errors=True)
        if not quiet:
            self.log("cluster stopped and its state removed" if existed else "no local cluster to stop")
        return existed

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        st = self.state()
        if st is None:
            return {"running": False, "components": []}
        return {
            "running": self.is_running(),
            "api_server": st["api_server"],
            "kubeconfig": st["kubeconfig"],
            "components": [dict(dataclasses.asdict(c), alive=c.alive) for c in self.components()],
            "real_nodes": st.get("real_nodes", []),
        }


def live_real_node_holder(log=print) -> str | None:
    """The cluster directory whose real nodes hold this host, or None. A claim left by a cluster that
    no longer runs (an interrupted test run) is taken down first, so it never blocks the next one."""
    holder = host.claim_holder()
    if holder is None:
        return None
    stale = LocalCluster(pathlib.Path(holder).parent, log=log)
    if stale.is_running():
        return holder
    log(f"taking down the real nodes of a local cluster that no longer runs ({holder})")
    stale.down(quiet=True)
    return host.claim_holder()


def node_manifest(name: str) -> dict:
    """A fake GPU Node that kwok manages, labelled like NVIDIA GPU feature discovery would."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.memory": str(GPU_MEMORY_MIB),
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
            },
        },
        "spec": {},
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_NODE)},
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_NODE)},
        },
    }
