"""``spec.gossip.prefixDigestSource`` (served | kvEvents) on InferenceNode and InferenceFleet: the CRD's
enum and default, and the operator refusing kvEvents where the runtime could not follow vLLM's KV cache
events (InvalidSpec, before any child is written). The runtime's mapping is in
tests/unit/runtime/test_incluster_prefix_digest.py."""

from __future__ import annotations

import datetime
import pathlib

import pytest
import yaml

from zerolayer.operator import fleet_plan as fp
from zerolayer.operator import plan as p
from zerolayer.operator import validation
from zerolayer.operator.config import OperatorConfig

REPO = pathlib.Path(__file__).resolve().parents[3]
NOW = datetime.datetime(2026, 12, 4, 12, tzinfo=datetime.timezone.utc)
KV_EVENTS = {"gossip": {"prefixDigestSource": "kvEvents"}}


def spec(runtime=None, **extra):  # type: ignore[no-untyped-def]
    return {"nodeName": "gpu-0", "models": [{"name": "tiny", "source": {"path": "/m"}}],
            "runtime": runtime or {}, **extra}


@pytest.mark.parametrize("crd", ["inferencenodes", "inferencefleets"])
def test_crd_enum_and_default(crd):
    doc = yaml.safe_load((REPO / f"crds/{crd}.zerolayer.io.yaml").read_text())
    gossip = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gossip"]
    field = gossip["properties"]["prefixDigestSource"]
    assert field["type"] == "string" and field["enum"] == ["served", "kvEvents"] and field["default"] == "served"
    assert gossip["default"] == {}  # a spec without gossip gets served too


@pytest.mark.parametrize("runtime, fragment", [
    ({"engine": "synthetic"}, "spec.runtime.engine is synthetic, which has none"),
    ({"enablePrefixCaching": False}, "needs spec.runtime.enablePrefixCaching"),
    ({"engineArgs": {"kv_events_config": {}}}, "remove kv_events_config from spec.runtime.engineArgs"),
])
def test_kv_events_is_refused_where_it_cannot_work(runtime, fragment):
    problems = validation.inference_node_problems(spec(runtime, **KV_EVENTS))
    assert any(fragment in x and x.startswith("spec.gossip.prefixDigestSource kvEvents") for x in problems), problems


@pytest.mark.parametrize("runtime, gossip", [
    ({}, {"prefixDigestSource": "kvEvents"}),
    ({"engine": "vllm", "enablePrefixCaching": True}, {"prefixDigestSource": "kvEvents"}),
    ({"engine": "synthetic", "enablePrefixCaching": False}, {"prefixDigestSource": "served"}),
    ({"engine": "synthetic"}, {}),
])
def test_kv_events_with_vllm_and_served_anywhere_are_valid(runtime, gossip):
    assert validation.inference_node_problems(spec(runtime, gossip=gossip)) == []


def test_the_inference_node_says_why_in_its_ready_condition():
    body = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "n0", "uid": "u0", "generation": 2},
            "spec": spec({"engine": "synthetic"}, **KV_EVENTS)}
    plan = p.plan_inference_node(p.InferenceNodeFacts(inode=body, config=OperatorConfig(), now=NOW))
    ready = next(c for c in plan.conditions if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "prefixDigestSource kvEvents" in ready["message"]
    assert plan.children == [] and plan.phase == "Degraded" and plan.invalid


def test_a_fleet_refuses_it_before_creating_members():
    fleet = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceFleet",
             "metadata": {"name": "f", "uid": "uid-f", "generation": 1},
             "spec": {"replicas": 1, "models": [{"name": "tiny", "source": {"path": "/m"}}],
                      "runtime": {"engine": "synthetic"}, **KV_EVENTS}}
    nodes = [{"metadata": {"name": "n1", "labels": {}}}]
    plan = fp.plan_inference_fleet(fleet, nodes, [], NOW)
    assert plan.phase == "Degraded" and not plan.children
    assert any("prefixDigestSource kvEvents" in x for x in plan.invalid)
    fleet["spec"]["runtime"] = {"engine": "vllm"}
    assert fp.plan_inference_fleet(fleet, nodes, [], NOW).invalid == []
