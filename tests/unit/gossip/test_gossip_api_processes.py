"""``status.apiProcesses``: a node says how many API processes serve its endpoint, so that a client opens
that many connections (docs/client.md). Published by process 0's gossip, carried by the map document, read
by the SDK."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from types import SimpleNamespace

import yaml

from zerolayer.client.nodes import nodes_from_document
from zerolayer.gpumap import FleetMap, node_from_object, render_map_document
from zerolayer.runtime.gossip.status import GossipState, Load, build_status, change_reason

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_every_status_says_how_many_api_processes_serve_it():
    assert build_status([], {}, Load(), endpoint="http://n:1", heartbeat=0.0)["apiProcesses"] == 1
    assert build_status([], {}, Load(), endpoint="http://n:1", heartbeat=0.0, api_processes=4)["apiProcesses"] == 4
    state = GossipState(endpoint="http://n:1", api_processes=2)
    plan = state.plan([], Load(), 0.0, 0.0)
    assert plan is not None and plan.status["apiProcesses"] == 2


def test_a_changed_count_goes_out_at_once():
    state = GossipState(endpoint="http://n:1")
    first = state.plan([], Load(), 0.0, 0.0)
    assert first is not None and first.status["apiProcesses"] == 1
    state.published(first, 0.0)
    assert state.plan([], Load(), 1.0, 1.0) is None  # nothing changed, no heartbeat due
    state.api_processes = 3
    second = state.plan([], Load(), 2.0, 2.0)
    assert second is not None and (second.reason, second.status["apiProcesses"]) == ("api-processes", 3)
    assert change_reason(first.status, second.status, state.settings) == "api-processes"


def test_the_map_document_carries_it_to_the_sdk():
    now = time.time()
    status = build_status([], {}, Load(), endpoint="http://gpu-a:8443", heartbeat=now, api_processes=2)
    inode = {"metadata": {"name": "gpu-a"}, "spec": {"nodeName": "n0"}, "status": status}
    older = {"metadata": {"name": "gpu-b"}, "spec": {"nodeName": "n1"},
             "status": {**{k: v for k, v in status.items() if k != "apiProcesses"}, "endpoint": "http://gpu-b:8443"}}
    assert node_from_object(inode, now).api_processes == 2
    document = json.loads(render_map_document(FleetMap((node_from_object(inode, now), node_from_object(older, now)),
                                                       now)))
    records = {r["name"]: r for r in document["nodes"]}
    assert records["gpu-a"]["apiProcesses"] == 2 and "apiProcesses" not in records["gpu-b"]
    nodes = {n.name: n for n in nodes_from_document(document)}
    assert (nodes["gpu-a"].api_processes, nodes["gpu-b"].api_processes) == (2, None)
    assert nodes_from_document({"items": [inode]})[0].api_processes == 2  # the InferenceNode list, as watched


def test_the_crd_and_the_chart_declare_it():
    for path in (REPO / "crds" / "inferencenodes.zerolayer.io.yaml",
                 REPO / "helm" / "zerolayer" / "crds" / "inferencenodes.zerolayer.io.yaml"):
        crd = yaml.safe_load(path.read_text())
        status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        assert status["apiProcesses"]["type"] == "integer" and status["apiProcesses"]["minimum"] == 1


async def test_the_node_agent_publishes_its_count(monkeypatch):
    """Process 0's agent publishes the node's count, given at construction (compose passes the config's)."""
    from zerolayer.runtime.engine.synthetic import SyntheticEngine
    from zerolayer.runtime.node import agent as node_agent

    patches: list[dict] = []

    class Sink:  # the InferenceNode's status subresource
        def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
            pass

        def get(self, name: str) -> dict:
            return {"metadata": {"name": name}, "spec": {}}

        def patch_status(self, name: str, status: dict) -> dict:
            patches.append(dict(status))
            return {"metadata": {"name": name}, "spec": {}, "status": dict(status)}

        def close(self) -> None:
            pass

    class Watcher:
        def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
            pass

        def start(self) -> "Watcher":
            return self

        def stop(self) -> None:
            pass

    monkeypatch.setattr(node_agent, "NodeApi", Sink)
    monkeypatch.setattr(node_agent, "GpuMapWatcher", Watcher)
    args = SimpleNamespace(node_name="gpu-1", kubeconfig=None, advertise_endpoint="http://gpu-1:8443")
    agent = node_agent.NodeAgent.from_args(args, None, api_processes=3)  # type: ignore[arg-type]
    server = SimpleNamespace(engine=SyntheticEngine(), draining=False, sample_interval_s=0.02, base_url=None,
                             host="127.0.0.1", port=8443, app=SimpleNamespace(demand=None))
    await agent.start(server)  # type: ignore[arg-type]
    try:
        for _ in range(250):
            if patches:
                break
            await asyncio.sleep(0.02)
    finally:
        await agent.stop()
    assert patches and patches[0]["apiProcesses"] == 3 and patches[0]["endpoint"] == "http://gpu-1:8443"
    assert node_agent.NodeAgent.from_args(args, None).api_processes == 1  # type: ignore[arg-type]
