"""Issue 6 on the real control plane: simulated memory climbs on node A -> A's status stops admitting
within one sample + one patch -> the gpumap reader, ``zerolayer map`` and the SDK see it -> a new
request's choice goes to node B; a node whose heartbeat stops goes stale.

The GPUs are *simulated* sources (no GPU here), sampled by the runtime's real 200 ms sampler; the
publishers, the API server, the watchers and the CLI are the real ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import yaml

from zerolayer.gpumap import FleetMap, GpuMapWatcher, load_custom_objects_api
from zerolayer.runtime.gossip import GossipPublisher, Load, RecordingSource
from zerolayer.runtime.gossip.kube import NodeApi
from zerolayer.runtime.gpu import GpuSampler, SimulatedGpuSource

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


class SimulatedNode:
    """One runtime's gossip chain: simulated GPU -> sampler -> recording source -> publisher -> API server."""

    def __init__(self, name: str, kubeconfig: str) -> None:
        self.name = name
        self.source = SimulatedGpuSource.constant(0.5, gpus=2)
        self.recording = RecordingSource(self.source)
        self.api = NodeApi(kubeconfig=kubeconfig)
        self.publisher = GossipPublisher(
            name, self.api, readings=lambda: self.recording.latest, load=lambda: Load(1, 0, 0.3),
            endpoint=f"http://{name}.test:8443", sample_seq=lambda: self.recording.seq)
        self.recording.on_sample = self.publisher.notify
        self.sampler = GpuSampler(self.recording, lambda sample: None, interval_s=0.2, name=f"sampler-{name}")

    def start(self) -> "SimulatedNode":
        self.publisher.start()
        self.sampler.start()
        return self

    def crash(self) -> None:
        """Stop heart-beating without a goodbye (what a dead runtime looks like)."""
        self.sampler.stop()
        self.publisher.stop(final=False)

    def close(self) -> None:
        self.sampler.stop()
        self.publisher.stop(final=False)
        self.api.close()


def _inference_node(name: str) -> dict:
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": name},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "m", "source": {"path": "/models/m"}}],
                     "gossip": {"heartbeatSeconds": 1, "staleAfterSeconds": 3, "maxPatchesPerSecond": 5,
                                "memoryStep": 0.05}}}


@pytest.fixture
def two_nodes(cluster):
    suffix = uuid.uuid4().hex[:6]
    names = [f"gossip-a-{suffix}", f"gossip-b-{suffix}"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([_inference_node(n) for n in names]))
    nodes = [SimulatedNode(n, cluster.kubeconfig).start() for n in names]
    watcher = GpuMapWatcher(kubeconfig=cluster.kubeconfig).start()
    try:
        yield nodes, watcher
    finally:
        watcher.stop()
        for node in nodes:
            node.close()
        cluster.kubectl("delete", "inferencenode", *names, "--wait=false", check=False)


def _admitting(fleet: FleetMap, name: str) -> bool | None:
    node = fleet.node(name)
    return None if node is None else node.admitting


def test_memory_climb_takes_node_a_out_and_new_requests_go_to_b(cluster, two_nodes):
    (a, b), watcher = two_nodes
    watcher.wait_for(lambda f: _admitting(f, a.name) and _admitting(f, b.name), timeout=30)
    fleet = watcher.snapshot()
    # a session whose consistent-hash owner is A, so the move to B is visible
    session = next(f"session-{i}" for i in range(1000)
                   if fleet.choose(f"session-{i}", exclude=[n.name for n in fleet.nodes
                                                            if n.name not in (a.name, b.name)])[0].name == a.name)

    a.source.set_memory(0.97, gpu=0)
    a.source.set_memory(0.96, gpu=1)
    seq_at_climb = a.recording.seq
    fleet = watcher.wait_for(lambda f: _admitting(f, a.name) is False, timeout=30)

    # within one sample + one patch: the first publication carrying a sample taken after the climb
    # already says "not admitting" (nothing in between told readers A still admitted)
    after = [r for r in a.publisher.history if r.ok and r.sample_seq is not None and r.sample_seq > seq_at_climb]
    assert after and after[0].admitting is False and after[0].reason == "admitting", list(a.publisher.history)

    node_a = fleet.node(a.name)
    assert node_a.reason == "runtime not admitting" and node_a.gpus_admitting == "0/2"
    assert node_a.memory_percent == 96  # (0.97 + 0.96) / 2, rounded
    status = cluster.kubectl_json("get", "inferencenode", a.name)["status"]
    assert status["admitting"] is False and status["gpusAdmitting"] == "0/2"

    # the new-request choice: gpumap's ring and the SDK's router both send the session to B now
    others = [n.name for n in fleet.nodes if n.name not in (a.name, b.name)]
    assert fleet.choose(session, exclude=others)[0].name == b.name
    from zerolayer.client.nodes import KubernetesNodeMap
    from zerolayer.client.routing import Router

    sdk_map = KubernetesNodeMap(load_custom_objects_api(cluster.kubeconfig))
    try:
        assert sdk_map.wait_ready(10)
        sdk_nodes = cluster.wait_for(lambda: {n.name: n for n in sdk_map.nodes()
                                              if n.name in (a.name, b.name)} or None, what="SDK map")
        assert sdk_nodes[a.name].admitting is False and sdk_nodes[b.name].admitting is True
        target = Router(sdk_map).choose(session)
        assert target.endpoint != f"http://{a.name}.test:8443"
    finally:
        sdk_map.close()

    # `zerolayer map` (the CLI, a separate process) shows the same verdicts
    env = cluster.env()
    table = subprocess.run([sys.executable, "-m", "zerolayer.cli", "map", "--once", "--kubeconfig", cluster.kubeconfig],
                           capture_output=True, text=True, env=env, timeout=60)
    assert table.returncode == 0, table.stderr
    line_a = next(line for line in table.stdout.splitlines() if line.startswith(a.name))
    line_b = next(line for line in table.stdout.splitlines() if line.startswith(b.name))
    assert "NO (runtime not admitting)" in line_a and " yes " in line_b
    doc = json.loads(subprocess.run([sys.executable, "-m", "zerolayer.cli", "map", "--json", "--kubeconfig",
                                     cluster.kubeconfig], capture_output=True, text=True, env=env,
                                    timeout=60, check=True).stdout)
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert by_name[a.name]["admitting"] is False and by_name[b.name]["admitting"] is True

    # memory falls below the resume mark: A admits again
    a.source.set_memory(0.5)
    watcher.wait_for(lambda f: _admitting(f, a.name) is True, timeout=30)


def test_heartbeat_loss_marks_a_node_stale(cluster, two_nodes):
    (a, b), watcher = two_nodes
    watcher.wait_for(lambda f: _admitting(f, a.name) and _admitting(f, b.name), timeout=30)
    before = len(a.publisher.history)
    b.crash()
    # steady state on A: heartbeats only (1 s), no change-driven patches
    fleet = watcher.wait_for(lambda f: f.node(b.name) is not None and f.node(b.name).stale, timeout=30)
    node_b = fleet.node(b.name)
    assert not node_b.admitting and node_b.reason.startswith("stale: heartbeat")
    assert node_b.age_s > 3
    assert cluster.kubectl_json("get", "inferencenode", b.name)["status"]["admitting"] is True  # as last published
    assert _admitting(fleet, a.name) is True
    steady = [r for r in list(a.publisher.history)[before:] if r.ok]
    assert steady and all(r.reason == "heartbeat" for r in steady), steady
