"""The shared reader: staleness, the utilisation rule, consistent-hash alternatives, the map document."""

from __future__ import annotations

import json
import subprocess
import sys

from zerolayer import gpumap
from zerolayer.gpumap import FleetMap, alternatives_header, node_from_object, render_map_document, utc_now_rfc3339

NOW = 1_800_000_000.0


def inode(name: str, *, age: float | None = 1.0, admitting: bool = True, gpus=None, stale_after=None,
          util_threshold=None, endpoint: str | None = "auto") -> dict:
    spec: dict = {"nodeName": f"node-{name}", "models": [{"name": "m", "source": "/m"}]}
    if stale_after is not None:
        spec["gossip"] = {"staleAfterSeconds": stale_after}
    if util_threshold is not None:
        spec["scheduler"] = {"utilizationThreshold": util_threshold}
    status: dict = {"admitting": admitting,
                    "gpus": gpus if gpus is not None else [{"uuid": f"{name}-g0", "index": 0, "utilization": 0.5,
                                                            "memoryUsedBytes": 10, "memoryTotalBytes": 100,
                                                            "admitting": True}]}
    if endpoint:
        status["endpoint"] = f"http://{name}:8443" if endpoint == "auto" else endpoint
    if age is not None:
        status["lastHeartbeat"] = utc_now_rfc3339(NOW - age)
    return {"metadata": {"name": name}, "spec": spec, "status": status}


def test_fresh_admitting_node():
    node = node_from_object(inode("a"), NOW)
    assert node.admitting and node.reason == "" and not node.stale
    assert abs(node.age_s - 1.0) < 0.01 and node.gpus_admitting == "1/1"
    assert node.gpus[0].memory_fraction == 0.1


def test_stale_heartbeat_is_not_admitting_with_the_default_and_the_spec_timeout():
    assert not node_from_object(inode("a", age=31), NOW).admitting
    assert node_from_object(inode("a", age=29), NOW).admitting
    old = node_from_object(inode("a", age=6, stale_after=5), NOW)
    assert old.stale and not old.admitting and old.reason.startswith("stale")
    never = node_from_object(inode("a", age=None), NOW)
    assert never.stale and never.reason == "never published"


def test_gpu_above_utilisation_threshold_leaves_the_admitting_set():
    gpus = [{"uuid": "g0", "index": 0, "utilization": 0.96, "admitting": True},
            {"uuid": "g1", "index": 1, "utilization": 0.20, "admitting": True}]
    node = node_from_object(inode("a", gpus=gpus), NOW)
    assert [g.admitting for g in node.gpus] == [False, True] and node.admitting and node.gpus_admitting == "1/2"
    hot = node_from_object(inode("a", gpus=gpus[:1]), NOW)
    assert not hot.admitting and hot.reason == "no GPU admitting"
    assert node_from_object(inode("a", gpus=gpus[:1], util_threshold=0.99), NOW).admitting


def test_runtime_refusal_and_missing_endpoint():
    assert node_from_object(inode("a", admitting=False), NOW).reason == "runtime not admitting"
    assert node_from_object(inode("a", endpoint=None), NOW).reason == "no endpoint"


def test_choose_is_the_sdk_ring_and_skips_non_admitting_nodes():
    from zerolayer.client.nodes import HashRing as SdkRing

    names = [f"n{i}" for i in range(6)]
    fleet = FleetMap.from_objects([inode(n) for n in names], NOW)
    for session in ("alice", "bob", "s-17", ""):
        ours = [n.name for n in fleet.choose(session, limit=6)]
        assert ours == list(SdkRing(names).walk(session))
    owner = fleet.choose("alice")[0].name
    without = FleetMap.from_objects([inode(n, admitting=n != owner) for n in names], NOW)
    assert without.choose("alice")[0].name == [n.name for n in fleet.choose("alice", limit=2)][1]


def test_alternatives_header_excludes_self_and_is_none_when_nobody_admits():
    fleet = FleetMap.from_objects([inode("a"), inode("b"), inode("c", age=100)], NOW)
    value = alternatives_header(fleet, "sess", self_name="a", limit=3)
    assert value == "http://b:8443"
    assert alternatives_header(FleetMap.from_objects([inode("a")], NOW), "s", self_name="a") is None
    assert alternatives_header(None, "s") is None


def test_map_document_is_what_the_sdk_http_map_reads():
    from zerolayer.client.nodes import nodes_from_document

    fleet = FleetMap.from_objects([inode("a"), inode("b", age=100)], NOW)
    doc = json.loads(render_map_document(fleet))
    assert [n["name"] for n in doc["nodes"]] == ["a", "b"]
    sdk = {n.name: n for n in nodes_from_document(doc)}
    assert sdk["a"].admitting and not sdk["b"].admitting
    assert abs(sdk["a"].heartbeat - (NOW - 1)) < 0.01


def test_reader_imports_without_the_runtime():
    code = ("import sys, zerolayer.gpumap; "
            "bad = [m for m in sys.modules if m.startswith(('zerolayer.runtime', 'zerolayer.operator', 'kubernetes'))];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert gpumap.GROUP == "zerolayer.io"


def test_map_table_shows_nodes_gpus_and_verdicts():
    from zerolayer.map_cli import render_table

    gpus = [{"uuid": "g0", "index": 0, "name": "H100", "utilization": 0.97, "memoryUsedBytes": 40 * 1024**3,
             "memoryTotalBytes": 80 * 1024**3, "admitting": True, "powerWatts": 500.0, "temperatureC": 70.0,
             "fragmentation": 0.1, "nvlinkErrors": 0}]
    text = render_table(FleetMap.from_objects([inode("a", gpus=gpus), inode("b", age=100)], NOW))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["NODE", "ENDPOINT", "/"]
    row_a = next(line for line in lines if line.startswith("a "))
    assert "NO (no GPU admitting)" in row_a and "0/1" in row_a
    gpu_row = lines[lines.index(row_a) + 1]
    assert "gpu0 H100" in gpu_row and "40.0/80.0" in gpu_row and "97%" in gpu_row and "NO" in gpu_row
    assert "NO (stale: heartbeat 100.0s old > 30s)" in next(line for line in lines if line.startswith("b "))
    assert lines[-1].startswith("2 node(s), 0 admitting")


def test_gossip_and_defrag_stay_below_the_server():
    code = ("import sys, zerolayer.runtime.gossip, zerolayer.runtime.node.agent, zerolayer.runtime.defrag.daemon, "
            "zerolayer.runtime.defrag.cli; "
            "bad = [m for m in sys.modules if m.startswith(('zerolayer.runtime.serving.server', 'zerolayer.runtime.serving.app', "
            "'zerolayer.runtime.scheduler', 'zerolayer.runtime.engine', 'zerolayer.operator', 'zerolayer.client'))];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
