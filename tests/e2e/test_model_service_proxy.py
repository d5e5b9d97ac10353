"""Issue 24, the plain-client path: the official ``openai`` SDK pointed at a model's Service gets answers
from every runtime behind it, through a real kube-proxy (iptables mode, the kernel's DNAT), and one
kept-alive connection stays on one runtime (what docs/routing.md says about connection-level balancing).

The kwok control plane has no service proxy and its pods run nothing, so this test supplies both, in a
network namespace of its own so nothing on the host changes: the real kube-proxy binary (built with the
real-node toolchain) watches this control plane from inside the namespace and programs its iptables
there; three real ``zerolayer runtime`` processes (synthetic engine) listen in the namespace on exactly
the pod IPs kwok gave the three runtime pods; the client runs in the namespace too. The Service, its
selector and the EndpointSlices are the operator's and the kube-controller-manager's own. The API
server listens on 127.0.0.1, so a small forwarder in the test carries kube-proxy's connections to it
over a veth pair. Requests counted are each runtime's own ``zerolayer_requests_total``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import urllib.parse

import pytest
import yaml

from tests.e2e.operator_harness import Objects, OperatorProcess, free_port, new_run_id
from zerolayer.cluster import build, node
from zerolayer.operator import model_plan as mp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

KEY = "sk-plain-client"
ROOT_SIDE, NS_SIDE = "10.250.0.1", "10.250.0.2"
CLIENT = pathlib.Path(__file__).with_name("plain_client.py")


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


class _Forward(socketserver.ThreadingTCPServer):
    """Bytes both ways between ``listen`` and ``target`` (the API server on loopback)."""

    daemon_threads = allow_reuse_address = True

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.target = target
        super().__init__(listen, _Pipe)


class _Pipe(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with socket.create_connection(self.server.target) as upstream:  # type: ignore[attr-defined]
            def pump(src: socket.socket, dst: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    while data := src.recv(65536):
                        dst.sendall(data)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
            back = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
            back.start()
            pump(self.request, upstream)
            back.join(30)


@contextlib.contextmanager
def namespace(run: str, pod_ips: list[str]):
    """A network namespace joined to the host by a veth pair, with ``pod_ips`` on its loopback."""
    ns, veth, peer = f"zl-svc-{run}", f"zlv{run}", f"zlp{run}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("addr", "add", f"{ROOT_SIDE}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("addr", "add", f"{NS_SIDE}/30", "dev", peer, ns=ns)
        for link in ("lo", peer):
            _ip("link", "set", link, "up", ns=ns)
        for address in pod_ips:  # on loopback: this kernel has no dummy links
            _ip("addr", "add", f"{address}/32", "dev", "lo", ns=ns)
        # A connect() to the ClusterIP is routed before kube-proxy's DNAT rewrites it: it needs a route.
        _ip("route", "add", "default", "via", ROOT_SIDE, ns=ns)
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)  # gone with the namespace anyway
        subprocess.run(["ip", "netns", "del", ns], check=True)


def _kubeconfig_via(kubeconfig: str, address: str, out: pathlib.Path) -> tuple[str, int]:
    """A copy of the admin kubeconfig that reaches the API server at ``address`` (its certificate names
    127.0.0.1, so the copy skips the name check); returns the API server's own host and port."""
    config = yaml.safe_load(pathlib.Path(kubeconfig).read_text())
    cluster = config["clusters"][0]["cluster"]
    url = urllib.parse.urlparse(cluster["server"])
    cluster["server"] = f"https://{address}"
    cluster.pop("certificate-authority-data", None)
    cluster.pop("certificate-authority", None)
    cluster["insecure-skip-tls-verify"] = True
    out.write_text(yaml.safe_dump(config))
    return url.hostname or "127.0.0.1", url.port or 443


def _runtime_config(address: str, directory: pathlib.Path) -> pathlib.Path:
    path = directory / f"runtime-{address}.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": address, "port": 8443},
        "engine": {"kind": "synthetic", "models": ["tiny"], "output_tokens": 4},
        "tenants": [{"name": "plain", "keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}],
                     "priorities": ["high", "normal", "low"]}],
        "gpu": {"source": "none"},
    }))
    return path


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (a network namespace for kube-proxy and the runtimes)")
    run = new_run_id()
    objects = Objects(cluster, f"zl-e2e-svc-{run}", run)
    cluster.kubectl("create", "namespace", objects.namespace)
    operator = OperatorProcess(cluster, objects.namespace, run, tmp_path_factory.mktemp("operator"))
    operator.start()
    try:
        nodes = objects.add_nodes(3)
        objects.apply(*(objects.inference_node(f"svc-{i}-{run}", n) for i, n in enumerate(nodes)))
        yield objects, nodes
    finally:
        objects.delete_all(operator)
        operator.stop()


def _ready_ips(objects, service: str) -> list[str]:
    slices = objects.items("endpointslices", objects.namespace, f"kubernetes.io/service-name={service}")
    return sorted(a for s in slices for e in s.get("endpoints") or () if (e.get("conditions") or {}).get("ready")
                  for a in e["addresses"])


@contextlib.contextmanager
def kube_proxy(ns: str, objects, nodes: list[str], workdir: pathlib.Path):
    """The real kube-proxy (iptables mode) in ``ns``, watching this control plane through a forwarder."""
    kubeconfig = workdir / "kube-proxy.kubeconfig"
    port = free_port()
    api = _kubeconfig_via(objects.cluster.kubeconfig, f"{ROOT_SIDE}:{port}", kubeconfig)
    forward = _Forward((ROOT_SIDE, port), api)
    threading.Thread(target=forward.serve_forever, daemon=True).start()
    config = node.kube_proxy_config(kubeconfig, free_port(), free_port())
    config.update(hostnameOverride=nodes[0], clusterCIDR="10.244.0.0/16", nodePortAddresses=[f"{NS_SIDE}/32"])
    (workdir / "kube-proxy.yaml").write_text(json.dumps(config))
    binary = str(build.ensure_node_binaries().path("kube-proxy"))
    try:
        with _running(ns, [binary, f"--config={workdir / 'kube-proxy.yaml'}", "--v=1"], workdir / "kube-proxy.log"):
            yield
    finally:
        forward.shutdown()
        forward.server_close()


@contextlib.contextmanager
def _running(ns: str, cmd: list[str], log: pathlib.Path):
    """``cmd`` inside ``ns`` for the block; SIGTERM, then SIGKILL after 20 s."""
    with open(log, "w") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_openai_sdk_through_the_models_service_reaches_every_runtime(cluster, fleet, tmp_path):
    objects, nodes = fleet
    service_name = mp.model_service_name("tiny")
    ips = cluster.wait_for(lambda: len(found := _ready_ips(objects, service_name)) == 3 and found, timeout=120,
                           what="three runtime pods Ready behind the model's Service")
    cluster_ip = objects.get("service", service_name, objects.namespace)["spec"]["clusterIP"]
    with namespace(objects.run_id, ips) as ns, kube_proxy(ns, objects, nodes, tmp_path), \
            contextlib.ExitStack() as runtimes:
        for address in ips:
            runtimes.enter_context(_running(ns, [sys.executable, "-m", "zerolayer.cli", "runtime", "--config",
                                                 str(_runtime_config(address, tmp_path))],
                                            tmp_path / f"runtime-{address}.log"))
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(CLIENT), cluster_ip, KEY, *ips],
                             capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:] + (tmp_path / "kube-proxy.log").read_text()[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    # 45 clients, each on its own connection: every runtime answered some (all three missed by chance
    # with probability 3 * (2/3)**45 < 1e-7 under kube-proxy's uniform choice).
    assert sorted(result["fresh_connections"]) == sorted(ips) and all(result["fresh_connections"].values())
    assert sum(result["fresh_connections"].values()) == 45
    # One client, 10 requests one after another on its kept-alive connection: all on one runtime.
    assert sorted(result["one_connection"].values()) == [0, 0, 10]
