"""Fleet rollouts (issue 25), table-tested on the pure planner: a change the runtimes take live (a LoRA
adapter the pod already sees) is written into every InferenceNode at once and rolls nothing; a change
that rolls the pod surges onto spare Nodes with ``rollout.maxSurge``, deleting an old InferenceNode only
while ``replicas`` Ready ones remain without it; with no spare Node it rolls in place within
``maxUnavailable``."""

from __future__ import annotations

import pytest

from zerolayer import models as layout
from zerolayer.operator import fleet_plan as fp

from .test_fleet import NOW, child, fleet, node

SPARE = [node("n1"), node("n2"), node("n3"), node("n4")]


def surging(replicas=1, surge=1, unavailable=0, **spec):
    return fleet(replicas, rollout={"maxSurge": surge, "maxUnavailable": unavailable}, **spec)


def created(plan):
    return [c["spec"]["nodeName"] for c in plan.children]


def removed(plan):
    return [(r.name, r.message) for r in plan.removals]


def test_an_adapter_the_pod_already_sees_is_written_everywhere_at_once_and_surges_nothing():
    f = surging(3, surge=1, unavailable=1)
    owned = [child(f, n, ready=True, beat=1) for n in ("n1", "n2", "n3")]
    f["spec"]["models"] = [{**f["spec"]["models"][0],
                            "loras": [{"name": "tiny-sql", "source": {"hostPath": {"path":
                                       f"{layout.ADAPTERS_HOST_DIR}/sql"}}}]}]
    assert fp.plan_inference_fleet(f, None, owned, NOW).needs_nodes  # the first adapter turns LoRA on:
    assert created(fp.plan_inference_fleet(f, SPARE, owned, NOW)) == ["n4"]  # that rolls pods, so it surges
    for x in owned:  # LoRA on already: a second adapter is live
        x["spec"]["models"] = f["spec"]["models"]
        x["metadata"]["annotations"][fp.TEMPLATE_HASH_ANNOTATION] = fp.template_hash(f["spec"])
    f["spec"]["models"][0]["loras"].append({"name": "tiny-chat", "source": {"path": "/opt/adapters/chat"}})
    plan = fp.plan_inference_fleet(f, None, owned, NOW)
    assert not plan.needs_nodes and removed(plan) == []
    assert created(plan) == ["n1", "n2", "n3"]  # all at once: no pod rolls, nothing becomes unavailable
    assert [a["name"] for a in plan.children[0]["spec"]["models"][0]["loras"]] == ["tiny-sql", "tiny-chat"]


def test_a_surge_places_the_new_template_on_a_spare_node_and_retires_the_old_once_it_is_ready():
    f = surging(1)
    old = child(f, "n1", ready=True, beat=1, stale_hash=True)
    plan = fp.plan_inference_fleet(f, None, [old], NOW)
    assert plan.needs_nodes  # it must see the Nodes to pick a spare one
    plan = fp.plan_inference_fleet(f, SPARE, [old], NOW)
    assert created(plan) == ["n2"] and removed(plan) == []
    assert plan.children[0]["metadata"]["annotations"][fp.TEMPLATE_HASH_ANNOTATION] == fp.template_hash(f["spec"])
    assert plan.retry is not None and plan.phase == "Progressing"

    new = child(f, "n2", ready=False, beat=1)
    plan = fp.plan_inference_fleet(f, SPARE, [old, new], NOW)
    assert created(plan) == [] and removed(plan) == []  # the new one is not Ready: the old one stays
    new = child(f, "n2", ready=True, beat=1)
    plan = fp.plan_inference_fleet(f, SPARE, [old, new], NOW)
    assert created(plan) == [] and removed(plan) == [("llama-n1", fp.ROLLED_OUT)]
    assert [n.reason for n in plan.notes] == ["RolledOut"]
    plan = fp.plan_inference_fleet(f, None, [new], NOW)
    assert not plan.writes and plan.phase == "Ready"


@pytest.mark.parametrize("replicas, surge, old_ready, new_ready, placed, retired", [
    (3, 1, 3, 0, 1, 0),      # one spare at a time
    (3, 2, 3, 0, 2, 0),      # two at a time
    (2, 1, 2, 1, 0, 1),      # 2 old + 1 new Ready: one old goes, the next surge follows on the next look
    (2, 1, 1, 0, 0, 1),      # an old one that is not Ready costs nothing to delete once a new one exists
    (1, 1, 1, 1, 0, 1),
])
def test_surge_table(replicas, surge, old_ready, new_ready, placed, retired):
    f = surging(replicas, surge=surge)
    olds = [f"o{i}" for i in range(replicas)]
    news = [f"s{i}" for i in range(1 if new_ready or retired else 0)]
    owned = [child(f, n, ready=i < old_ready, beat=1, stale_hash=True) for i, n in enumerate(olds)]
    owned += [child(f, n, ready=i < new_ready, beat=1) for i, n in enumerate(news)]
    nodes = [node(n) for n in olds + news + ["x1", "x2", "x3"]]
    plan = fp.plan_inference_fleet(f, nodes, owned, NOW)
    assert len(plan.children) == placed and all(c["spec"]["nodeName"].startswith("x") for c in plan.children)
    assert len(plan.removals) == retired and all(m == fp.ROLLED_OUT for _, m in removed(plan))
    kept_ready = sum(x["status"]["conditions"][0]["status"] == "True" for x in owned
                     if x["metadata"]["name"] not in {r.name for r in plan.removals})
    assert kept_ready >= min(replicas, old_ready + new_ready)  # never fewer Ready than before the step


@pytest.mark.parametrize("unavailable, rolled", [(1, ["n1"]), (0, [])])
def test_without_a_spare_node_it_rolls_in_place_within_max_unavailable(unavailable, rolled):
    f = surging(2, surge=1, unavailable=unavailable)
    owned = [child(f, n, ready=True, beat=1, stale_hash=True) for n in ("n1", "n2")]
    plan = fp.plan_inference_fleet(f, [node("n1"), node("n2")], owned, NOW)
    assert created(plan) == rolled and removed(plan) == []
    if rolled:
        assert [n.reason for n in plan.notes] == ["NoSpareNode"]
    else:  # maxUnavailable 0: it waits for a Node, and says so
        selected = next(c for c in plan.conditions if c["type"] == "NodesSelected")
        assert selected["reason"] == "NotEnoughNodes" and plan.phase == "Degraded"


def test_max_surge_and_max_unavailable_both_zero_is_invalid():
    f = surging(1, surge=0, unavailable=0)
    plan = fp.plan_inference_fleet(f, SPARE, [child(f, "n1", ready=True, beat=1, stale_hash=True)], NOW)
    assert plan.invalid and "maxSurge 0 and maxUnavailable 0" in plan.invalid[0] and not plan.writes
