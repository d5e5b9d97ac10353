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

import dataclasses
import json
import os
import pathlib
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from zerolayer.cluster import build, controlplane, host, images, node, pki, processes, versions
from zerolayer.cluster.controlplane import SERVICE_CIDR, Plane
from zerolayer.cluster.processes import Component, free_port

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_MEMORY_MIB = 81559
GPUS_PER_NODE = 8
NODE_PREFIX = "gpu-node-"


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


def reuse_refusal(asked: int, running: int) -> str | None:
    """Why a running cluster with ``running`` real nodes cannot serve an ``up`` asking for ``asked``.

    Real nodes join only when the control plane starts: its API server then listens on the node
    bridge with a certificate for that address (a kwok-only cluster listens on 127.0.0.1).
    """
    if asked <= running:
        return None
    return (f"the running local cluster has {running} real node(s) and {asked} were asked for; real nodes join "
            "only when the control plane starts (its API server then listens on the node bridge). Run "
            f"`zerolayer cluster down`, then `zerolayer cluster up --real-nodes {asked}` again (or the script that "
            "ran it, such as examples/quickstart-real-node.sh)")


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
        return str(st["api_server"]) if st else None

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
        proc = processes.launch(state, self.state_file, self.logs, name, [exe, *args], port)
        self._children[proc.pid] = proc
        return proc.pid

    def up(self, nodes: int = 3, timeout: float = 180, real_nodes: int = 0) -> str:
        """Start the control plane (or reuse a running one); returns "started" or "reused".

        ``real_nodes`` > 0 adds that many real nodes (root only; one such cluster per host): see
        :mod:`zerolayer.cluster.node`. Raises ClusterError when a previous cluster is half-alive
        (some processes dead): the caller should run ``down`` first rather than get a silently
        broken cluster, and when the host cannot run real nodes (before changing anything).
        """
        if self.state() is not None:
            return self._reuse(real_nodes)
        started = time.monotonic()
        if real_nodes:
            self._check_real_node_host()
        tc = self._toolchain = build.ensure_binaries(self.log)
        node_tc = build.ensure_node_binaries(self.log) if real_nodes else None
        plane, state = self._prepare(tc, real_nodes)
        try:
            if real_nodes:
                host.acquire(self.dir)
                host.setup_network()
            self._start_control_plane(plane, state, tc)
            if nodes:
                self.add_nodes(range(nodes))
            if real_nodes and node_tc is not None:
                self._start_real_nodes(state, real_nodes, node_tc)
            self._wait_usable(nodes + real_nodes, started + timeout)
        except BaseException:
            self.log("start failed; stopping what was started (logs kept in the error below)")
            tails = self._log_tails()
            self.down(quiet=True)
            if tails:
                self.log(tails)
            raise
        self.log(f"cluster up in {time.monotonic() - started:.1f}s: API server {plane.api_url}, {nodes} fake GPU "
                 f"nodes, {real_nodes} real nodes; kubeconfig {self.kubeconfig}")
        return "started"

    def _reuse(self, real_nodes: int) -> str:
        """A recorded cluster: "reused" when it runs and has the real nodes asked for, else ClusterError."""
        if self.is_running():
            refusal = reuse_refusal(real_nodes, len(self.real_nodes()))
            if refusal:
                raise ClusterError(refusal)
            self.log(f"cluster already running (API server {self.api_url()}); reusing it")
            return "reused"
        dead = [c.name for c in self.components() if not c.alive]
        raise ClusterError(
            f"a previous local cluster in {self.dir} is not healthy (stopped: {', '.join(dead) or 'none'}); "
            "run `zerolayer cluster down` and then `up` again"
        )

    def _check_real_node_host(self) -> None:
        """Refuse real nodes, before changing anything, where the host cannot run them or another holds it."""
        reason = host.unsupported_reason()
        if reason:
            raise ClusterError(f"cannot run real nodes here: {reason}")
        holder = live_real_node_holder(self.log)
        if holder is not None and holder != str(self.dir):
            raise ClusterError(f"real nodes of another local cluster ({holder}) hold this host; "
                               "take that one down first")

    def _prepare(self, tc: build.Toolchain, real_nodes: int) -> tuple[Plane, dict]:
        """Directories, PKI, ports and kubeconfigs of a new control plane, and its first state."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        plane = Plane(self.dir, host.GATEWAY_IP if real_nodes else "127.0.0.1",
                      {n: free_port() for n in controlplane.PORTS}, real_nodes=bool(real_nodes))
        pki.create(self.pki, extra_ips=(host.GATEWAY_IP,) if real_nodes else ())
        state = {"api_server": plane.api_url, "bin_dir": str(tc.bin_dir), "versions": versions.STAMP,
                 "kubeconfig": str(self.kubeconfig), "components": [], "real_nodes": []}
        for user in ("admin", "controller-manager", "scheduler"):
            path = self.kubeconfig if user == "admin" else self.dir / f"{user}.kubeconfig"
            path.write_text(pki.kubeconfig(plane.api_url, self.pki, user))
            path.chmod(0o600)
        if real_nodes:
            self.state_file.write_text(json.dumps(state, indent=2))  # so `down` finds the host claim's owner
        return plane, state

    def _start_control_plane(self, plane: Plane, state: dict, tc: build.Toolchain) -> None:
        """etcd, the API server (each waited for), the controller manager, the scheduler and kwok."""
        def launch(name: str, args: list[str], port: str) -> None:
            self._launch(state, name, str(tc.path(name)), args, plane.ports[port])

        launch("etcd", controlplane.etcd_args(plane), "etcd")
        self._wait(lambda: self._http_ok(f"{plane.etcd_url}/health"), 30, "etcd")
        launch("kube-apiserver", controlplane.apiserver_args(plane), "apiserver")
        self._wait(self.healthy, 90, "kube-apiserver")
        launch("kube-controller-manager", controlplane.controller_manager_args(plane), "controller-manager")
        launch("kube-scheduler", controlplane.scheduler_args(plane), "scheduler")
        launch("kwok", controlplane.kwok_args(plane, self.kubeconfig, tc.kwok_stages), "kwok")

    def _wait_usable(self, nodes: int, deadline: float) -> None:
        """Until ``deadline``: every node Ready and the default ServiceAccount made (pods can be created)."""
        self._wait(lambda: self._nodes_ready(nodes), max(5.0, deadline - time.monotonic()), "nodes Ready")
        self._wait(lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default",
                                        check=False).returncode == 0,
                   max(5.0, deadline - time.monotonic()), "default ServiceAccount")

    def _start_real_nodes(self, state: dict, count: int, tc: build.NodeToolchain) -> None:
        """Start each real node's containerd and kubelet, then the host's kube-proxy and kube-router."""
        def alive() -> None:
            dead = [c.name for c in self.components() if not c.alive]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited while starting real nodes")

        def launch(name, exe, args, port):
            return self._launch(state, name, exe, args, port)

        real = [node.RealNode(i, self.dir / "nodes" / f"{node.REAL_NODE_PREFIX}{i}", free_port(), free_port())
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
                                   service_cidr=SERVICE_CIDR, tc=tc, ports=(free_port(), free_port()),
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
                names = images.import_image(n.socket, os.fspath(archive))
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

    _http_ok = staticmethod(processes.http_ok)

    def _wait(self, check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        processes.wait(check, timeout, what, self.components, ClusterError)

    def _log_tails(self) -> str:
        return processes.log_tails(self.logs.glob("*.log")) if self.logs.exists() else ""

    # ------------------------------------------------------------------ down
    def down(self, quiet: bool = False) -> bool:
        """Stop every recorded process (TERM, then KILL after 10 s) and remove the state directory.

        Returns False when there was nothing to stop. Safe to call twice.
        """
        processes.stop(self.components() if self.state_file.exists() else [], self._children)
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
