"""The InferenceFleet planner (operator/zerolayer/operator/fleet_plan.py) and its CRD: placement,
owner references, stable names, scale up/down on drained nodes only, demand from zero, rollout."""

from __future__ import annotations

import datetime
import pathlib

import pytest
import yaml

from zerolayer.operator import fleet_plan as fp

REPO = pathlib.Path(__file__).resolve().parents[3]
NOW = datetime.datetime(2026, 12, 4, 12, 0, 0, tzinfo=datetime.timezone.utc)


def ts(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def fleet(replicas=2, **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": "llama", "uid": "uid-f", "generation": 3, "labels": {"team": "a"}},
            "spec": {"replicas": replicas, "nodeSelector": {"gpu": "yes"},
                     "models": [{"name": "tiny", "source": {"path": "/models/tiny"}}], **spec}}


def node(name, gpu="yes", **extra):
    return {"metadata": {"name": name, "labels": {"gpu": gpu, **extra.pop("labels", {})}}, **extra}


NODES = [node("n3"), node("n1"), node("n2"), node("cpu", gpu="no")]


def child(f, node_name, *, ready=False, beat=None, load=None, models=("tiny",), stale_hash=False, **status):
    obj = fp.build_inference_node(f, node_name)
    if stale_hash:  # made from the fleet's previous template, whose model the pod loads at start
        obj["metadata"]["annotations"][fp.TEMPLATE_HASH_ANNOTATION] = "old"
        obj["spec"]["models"] = [{**x, "source": {"path": "/models/previous"}} for x in obj["spec"]["models"]]
    obj["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                     "admitting": True, "models": list(models), "load": load or {}, **status}
    if beat is not None:
        obj["status"]["lastHeartbeat"] = ts(beat)
    return obj


def test_crd_copies_the_inference_node_spec_fields_and_has_the_scale_subresource():
    inode = yaml.safe_load((REPO / "crds/inferencenodes.zerolayer.io.yaml").read_text())
    crd = yaml.safe_load((REPO / "crds/inferencefleets.zerolayer.io.yaml").read_text())
    ispec = inode["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    version = crd["spec"]["versions"][0]
    fspec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert set(ispec) - {"nodeName", "gpuType"} == set(fp.TEMPLATE_FIELDS)
    for field in fp.TEMPLATE_FIELDS:
        assert fspec[field] == ispec[field], field
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert crd["spec"]["group"] == inode["spec"]["group"] and crd["spec"]["scope"] == "Cluster"


def test_creates_one_owned_inference_node_per_selected_node_in_name_order():
    f = fleet(2)
    plan = fp.plan_inference_fleet(f, NODES, [], NOW)
    assert [c["metadata"]["name"] for c in plan.children] == ["llama-n1", "llama-n2"]
    c = plan.children[0]
    assert c["spec"]["nodeName"] == "n1" and c["spec"]["models"] == f["spec"]["models"]
    ref = c["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["uid"], ref["controller"], ref["blockOwnerDeletion"]) == \
        ("InferenceFleet", "uid-f", True, True)
    assert c["metadata"]["labels"]["team"] == "a" and c["metadata"]["labels"][fp.FLEET_LABEL] == "llama"
    assert plan.status["selector"] == "zerolayer.io/fleet=llama" and plan.status["replicas"] == 0
    assert plan.phase == "Progressing" and plan.scale_to is None


def test_steady_fleet_needs_no_nodes_and_writes_nothing():
    f = fleet(2)
    owned = [child(f, "n1", ready=True, beat=1), child(f, "n2", ready=True, beat=1)]
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert not plan.needs_nodes and not plan.writes
    assert (plan.phase, plan.status["readyReplicas"], plan.status["servingReplicas"]) == ("Ready", 2, 2)
    assert plan.status["observedGeneration"] == 3


def test_placing_without_nodes_asks_for_them():
    assert fp.plan_inference_fleet(fleet(1), None, [], NOW).needs_nodes


def test_never_two_on_one_node_and_skips_nodes_taken_by_others():
    f = fleet(3)
    hand_written = {"metadata": {"name": "by-hand"}, "spec": {"nodeName": "n1"}}
    owned = [child(f, "n2")]
    plan = fp.plan_inference_fleet(f, NODES, [hand_written, *owned], NOW)
    assert [c["spec"]["nodeName"] for c in plan.children] == ["n3"]
    # 3 wanted, n2 owned, n3 new, n1 taken, cpu not selected: one short.
    selected = next(c for c in plan.conditions if c["type"] == "NodesSelected")
    assert selected["status"] == "False" and selected["reason"] == "NotEnoughNodes"
    assert plan.phase == "Degraded" and plan.retry is not None


@pytest.mark.parametrize("spec,labels,status,ok", [
    ({"gpuType": "H200"}, {"nvidia.com/gpu.product": "H200"}, {}, True),
    ({"gpuType": "H200"}, {"zerolayer.io/gpu-type": "A100"}, {}, False),
    ({"gpuCount": 4}, {}, {"allocatable": {"nvidia.com/gpu": "8"}}, True),
    ({"gpuCount": 4}, {}, {"allocatable": {"nvidia.com/gpu": "2"}}, False),
    ({"gpuCount": 4}, {"nvidia.com/gpu.count": "4"}, {}, True),
    ({"gpuCount": 1}, {}, {}, False),
])
def test_node_matching(spec, labels, status, ok):
    n = node("x", labels=labels, status=status)
    assert fp.node_matches({"nodeSelector": {"gpu": "yes"}, **spec}, n) is ok


def test_unschedulable_nodes_are_not_chosen():
    assert not fp.node_matches({}, {"metadata": {"name": "x"}, "spec": {"unschedulable": True}})


def test_kubectl_scale_down_removes_only_drained_nodes_newest_first():
    f = fleet(1)
    owned = [child(f, "n1", ready=True, beat=1, load={"running": 0}),
             child(f, "n2", ready=True, beat=1, load={"running": 2}),
             child(f, "n3", ready=True, beat=1, load={"running": 0, "waiting": 0})]
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    # Two to remove: n3 and n1 are drained (newest name first), n2 is busy and is kept.
    assert fp.removed_now(plan) == ["llama-n3", "llama-n1"]
    assert plan.retry is not None and "streams" not in plan.retry.message
    f0 = fleet(0)
    plan = fp.plan_inference_fleet(f0, None, owned, NOW)
    assert fp.removed_now(plan) == ["llama-n3", "llama-n1"]
    assert plan.retry is not None and "streams" in plan.retry.message


def test_not_ready_and_silent_nodes_go_first():
    f = fleet(1)
    owned = [child(f, "n1", ready=True, beat=1), child(f, "n2", ready=False, beat=None)]
    assert fp.removed_now(fp.plan_inference_fleet(f, None, owned, NOW)) == ["llama-n2"]
    # A stale heartbeat means no runtime is serving there: nothing to drain.
    busy_but_stale = [child(f, "n1", ready=True, beat=1, load={"running": 1}),
                      child(f, "n2", ready=True, beat=120, load={"running": 5})]
    assert fp.removed_now(fp.plan_inference_fleet(f, None, busy_but_stale, NOW)) == ["llama-n2"]


def test_autoscaler_scales_from_zero_on_demand_recorded_anywhere():
    f = fleet(0, autoscaling={"minReplicas": 0, "maxReplicas": 3})
    other = {"metadata": {"name": "other"}, "spec": {"nodeName": "n9"},
             "status": {"demand": [{"model": "tiny", "requests": 2, "lastRequested": ts(5)},
                                   {"model": "elsewhere", "requests": 9, "lastRequested": ts(5)}]}}
    plan = fp.plan_inference_fleet(f, NODES, [other], NOW)
    assert plan.scale_to == 1 and [c["spec"]["nodeName"] for c in plan.children] == ["n1"]
    assert plan.status["load"]["demand"] == 2 and plan.status["lastScaleTime"] == ts(0)
    assert any(n.reason == "Scaled" for n in plan.notes)
    # Old demand does not count.
    other["status"]["demand"][0]["lastRequested"] = ts(fp.DEMAND_WINDOW_S + 1)
    idle = fp.plan_inference_fleet(f, NODES, [other], NOW)
    assert idle.scale_to is None and idle.phase == "Idle" and not idle.children


def test_autoscaler_scales_up_on_load_and_remembers_its_recommendation():
    f = fleet(1, autoscaling={"minReplicas": 0, "maxReplicas": 3, "target": 4})
    owned = [child(f, "n1", ready=True, beat=1, load={"waiting": 10, "running": 4})]
    plan = fp.plan_inference_fleet(f, NODES, owned, NOW)
    assert plan.scale_to == 3 and [c["spec"]["nodeName"] for c in plan.children] == ["n2", "n3"]
    assert plan.status["recommendations"][-1] == {"time": ts(0), "replicas": 3}
    auto = next(c for c in plan.conditions if c["type"] == "AutoscalerActive")
    assert auto["reason"] == "Load"


def test_autoscaler_scale_down_waits_for_its_window():
    f = fleet(2, autoscaling={"minReplicas": 0, "maxReplicas": 3})
    f["status"] = {"recommendations": [{"time": ts(100), "replicas": 2}]}
    owned = [child(f, "n1", ready=True, beat=1), child(f, "n2", ready=True, beat=1)]
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert plan.scale_to is None and not plan.removals
    f["status"] = {"recommendations": [{"time": ts(400), "replicas": 2}, {"time": ts(301), "replicas": 0}]}
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert plan.scale_to == 0 and fp.removed_now(plan) == ["llama-n2", "llama-n1"]


def test_rollout_changes_at_most_max_unavailable_ready_nodes():
    f = fleet(3)
    owned = [child(f, n, ready=True, beat=1, stale_hash=True) for n in ("n1", "n2", "n3")]
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert [c["spec"]["nodeName"] for c in plan.children] == ["n1"]
    assert plan.retry is not None and plan.phase == "Progressing"
    # One already changed and not Ready yet: the budget of 1 is spent.
    owned[0] = child(f, "n1", ready=False, beat=1)
    assert fp.plan_inference_fleet(f, None, owned, NOW).children == []
    f["spec"]["rollout"] = {"maxUnavailable": 2}
    assert [c["spec"]["nodeName"] for c in fp.plan_inference_fleet(f, None, owned, NOW).children] == ["n2"]


def test_status_aggregates_gossiped_load_of_fresh_members():
    f = fleet(2)
    owned = [child(f, "n1", ready=True, beat=1, load={"running": 3, "waiting": 1, "kvCacheUsage": 0.5}),
             child(f, "n2", ready=True, beat=1, load={"running": 1, "waiting": 0, "kvCacheUsage": 0.3}),
             child(f, "n3", ready=True, beat=999, load={"running": 50})]
    owned[2]["metadata"]["deletionTimestamp"] = ts(1)
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert plan.status["load"] == {"running": 4, "waiting": 1, "kvCacheUsage": 0.4, "demand": 0}
    assert plan.status["nodes"] == ["n1", "n2"] and plan.status["replicas"] == 2


def test_serving_requires_every_model_listed_and_fresh_gossip():
    f = fleet(2)
    owned = [child(f, "n1", ready=True, beat=1, models=()), child(f, "n2", ready=True, beat=100)]
    assert fp.plan_inference_fleet(f, None, owned, NOW).status["servingReplicas"] == 0


def test_names_are_stable_and_fit():
    assert fp.child_name("f", "node-1") == "f-node-1"
    long = fp.child_name("f" * 200, "n" * 200)
    assert len(long) <= 253 and long == fp.child_name("f" * 200, "n" * 200)


def test_invalid_spec_is_reported():
    f = fleet(1)
    f["spec"]["models"] = []
    plan = fp.plan_inference_fleet(f, NODES, [], NOW)
    assert plan.invalid and plan.phase == "Degraded" and not plan.children


def test_an_inference_node_whose_node_is_gone_is_replaced_on_another_node():
    f = fleet(2)
    lost = child(f, "n1", ready=False)
    lost["status"]["conditions"] = [{"type": "NodeFound", "status": "False", "reason": "NodeMissing"}]
    owned = [lost, child(f, "n2", ready=True, beat=1)]
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert plan.needs_nodes  # a replacement must be placed
    plan = fp.plan_inference_fleet(f, [node("n2"), node("n3")], owned, NOW)
    assert fp.removed_now(plan) == ["llama-n1"] and [c["spec"]["nodeName"] for c in plan.children] == ["n3"]
    assert any(n.reason == "Replacing" for n in plan.notes) and plan.status["replicas"] == 1
    selected = next(c for c in plan.conditions if c["type"] == "NodesSelected")
    assert selected["message"].startswith("2 of 2")
