"""GpuMapWatcher on demand: no watch until the map is used, closed again when it goes unused, reopened
(with a fresh LIST) on the next use; against the local control plane."""

from __future__ import annotations

import json
import uuid

import pytest

from zerolayer.gpumap import GpuMapWatcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_the_map_is_watched_only_while_it_is_used(cluster):
    name = f"gpumap-od-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": name},
        "spec": {"nodeName": "x", "models": [{"name": "m", "source": {"path": "/m"}}]}}))
    watcher = GpuMapWatcher(kubeconfig=cluster.kubeconfig, on_demand_idle_s=1.0).start()
    try:
        assert not watcher.watching and watcher.counters.lists == 0  # started, yet nothing opened
        watcher.wait_for(lambda fleet: fleet.node(name) is not None, timeout=30)
        assert watcher.watching and watcher.counters.lists == 1
        cluster.wait_for(lambda: not watcher.watching, timeout=30, what="the unused watch closed")
        lists = watcher.counters.lists
        fleet = watcher.wait_for(lambda fleet: fleet.node(name) is not None, timeout=30)  # used again
        assert watcher.watching and watcher.counters.lists == lists + 1 and fleet.node(name) is not None
    finally:
        watcher.stop()
        cluster.kubectl("delete", "inferencenode", name, "--wait=false", check=False)
