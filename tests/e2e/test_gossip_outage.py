"""The API server goes away and comes back: the publisher and the map watcher survive and recover.

The runtime side reaches the real API server through a TCP relay that the test cuts (every
connection closed, nothing listening) and restores on the same port, which is what a
restarting API server or a network partition looks like from the node.
"""

from __future__ import annotations

import pathlib
import re
import socket
import threading
import time
import uuid

import pytest
import yaml

from zerolayer.gpumap import GpuMapWatcher, parse_rfc3339
from zerolayer.runtime.gossip import GossipPublisher, Load, RecordingSource
from zerolayer.runtime.gossip.kube import NodeApi
from zerolayer.runtime.gpu import GpuSampler, SimulatedGpuSource

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


class Relay:
    """A TCP relay to ``upstream`` on a fixed local port that can be cut and restored."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> "Relay":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_publisher_and_watcher_survive_an_api_server_outage(cluster, tmp_path):
    text = pathlib.Path(cluster.kubeconfig).read_text()
    host, port = re.search(r"server: https://([\d.]+):(\d+)", text).groups()
    relay = Relay((host, int(port))).start()
    relayed = tmp_path / "kubeconfig"
    relayed.write_text(text.replace(f"https://{host}:{port}", f"https://127.0.0.1:{relay.port}"))

    name = f"gossip-outage-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": name},
        "spec": {"nodeName": "gpu-node-0", "models": [{"name": "m", "source": {"path": "/m"}}],
                 "gossip": {"heartbeatSeconds": 1, "staleAfterSeconds": 30}}}))
    source = SimulatedGpuSource.constant(0.5)
    recording = RecordingSource(source)
    api = NodeApi(kubeconfig=str(relayed), timeout_s=2)
    publisher = GossipPublisher(name, api, readings=lambda: recording.latest, load=Load, endpoint="http://x:1")
    recording.on_sample = publisher.notify
    sampler = GpuSampler(recording, lambda s: None)
    watcher = GpuMapWatcher(kubeconfig=str(relayed), retry_s=0.5, watch_timeout_s=5)
    try:
        publisher.start()
        sampler.start()
        watcher.start()
        watcher.wait_for(lambda f: f.node(name) is not None and f.node(name).admitting, timeout=30)

        relay.cut()
        cluster.wait_for(lambda: publisher.failures >= 2, timeout=30, what="failed patches while cut")
        assert publisher.running and isinstance(publisher.last_error, Exception)
        source.set_memory(0.97)  # changes while the API server is away must not be lost
        time.sleep(1.0)
        cut_at = time.time()

        relay.start()  # same port
        fleet = watcher.wait_for(lambda f: f.node(name) is not None and f.node(name).admitting is False,
                                 timeout=60)
        assert fleet.node(name).heartbeat >= cut_at - 1
        status = cluster.kubectl_json("get", "inferencenode", name)["status"]
        assert status["admitting"] is False and parse_rfc3339(status["lastHeartbeat"]) > cut_at
        # The watcher can see the patch before the publisher's thread has read the API server's answer to
        # it (and cleared its failure count): wait for that, briefly, instead of reading it at once.
        cluster.wait_for(lambda: publisher.state.failures == 0, timeout=10, what="failure count cleared")
        assert publisher.running
        before = publisher.patches
        cluster.wait_for(lambda: publisher.patches >= before + 2, timeout=30, what="heartbeats after recovery")
    finally:
        sampler.stop()
        publisher.stop(final=False)
        watcher.stop()
        api.close()
        relay.cut()
        cluster.kubectl("delete", "inferencenode", name, "--wait=false", check=False)
