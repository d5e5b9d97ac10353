"""Pure planning for an InferenceFleet: which InferenceNodes to create, change and delete, what
replica count to run, and the status to show. No I/O and no clock (``now`` is a fact).

``plan_inference_fleet(fleet, nodes, inference_nodes, now)`` works like a ReplicaSet controller whose
pods are InferenceNodes:

- **Owned** InferenceNodes are those whose controller owner reference is the fleet's uid. They are
  named ``<fleet>-<node>`` (stable: the same Node always gets the same name) and carry the fleet's
  labels plus ``zerolayer.io/fleet``.
- **Placement.** A Node is eligible when it matches ``nodeSelector``, ``gpuType`` and ``gpuCount``,
  is schedulable, and no InferenceNode at all (the fleet's, another fleet's or a hand-written one)
  is on it: never two runtimes on one Node. New InferenceNodes go to eligible Nodes in name order.
  ``nodes`` may be None (not read): a plan that needs to place then says ``needs_nodes`` and the
  reconciler reads the Nodes and plans again; a steady fleet never lists Nodes.
- **Replicas.** ``spec.replicas``, or with ``spec.autoscaling`` the decision of :mod:`.autoscale`
  from the owned InferenceNodes' gossiped load and the demand any runtime recorded for the fleet's
  models (then ``scale_to`` asks the reconciler to write it into ``spec.replicas``, the scale
  subresource's field, so ``kubectl get`` and HPA-style tools see one number).
- **Scale down** removes only drained InferenceNodes: no running or waiting streams at a fresh
  heartbeat, or no fresh heartbeat at all (no runtime is serving there). Not-Ready ones go first,
  then the newest-named. A busy InferenceNode is kept and the plan looks again after
  :data:`DRAIN_RECHECK_S`.
- **Changes** of the template. One the runtimes take live (LoRA adapters the pod already sees,
  scheduler marks, gossip and defrag settings: :func:`~.manifests.runtime_config_hash` unchanged) is
  written into every outdated InferenceNode at once: no pod rolls. One that rolls the pod (model,
  engine, image) is a rollout (:func:`_rollout`): with ``rollout.maxSurge`` above 0 it surges, new
  InferenceNodes on spare Nodes first and an old one deleted only while ``replicas`` Ready ones
  remain without it (so a Ready old one goes once a new one is Ready); without a spare Node, or with
  ``maxSurge`` 0, the change is written into at most ``rollout.maxUnavailable`` Ready InferenceNodes
  at a time (each rolls its own pod). Both 0 is invalid (nothing could ever change).

:class:`FleetPlan` is the InferenceNode planner's :class:`~.plan.Plan` with two fields more.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from typing import Any, Mapping, Sequence

from zerolayer.operator import autoscale
from zerolayer.operator import conditions as cond
from zerolayer.operator import manifests as m
from zerolayer.operator import validation
from zerolayer.operator.plan import Note, Plan, Removal, Retry

KIND = "InferenceFleet"
FLEET_LABEL = "zerolayer.io/fleet"
TEMPLATE_HASH_ANNOTATION = "zerolayer.io/fleet-template-hash"
# The InferenceNode spec fields a fleet copies into each InferenceNode it makes (the CRD copies
# their schema; tests/unit/operator/test_fleet.py checks both lists agree).
TEMPLATE_FIELDS = ("models", "runtime", "scheduler", "gossip", "defrag", "audit")
GPU_TYPE_LABELS = ("zerolayer.io/gpu-type", "nvidia.com/gpu.product")
DRAIN_RECHECK_S = 5.0
# Demand a runtime recorded this recently counts (a request refused for want of a node).
DEMAND_WINDOW_S = 120.0
# A heartbeat older than this (or the node's own gossip.staleAfterSeconds) is not serving.
STALE_AFTER_S = 30.0
SCALED_DOWN = "fleet scaled down; its streams have drained"
ROLLED_OUT = "rolled out: the fleet keeps its Ready replicas without it (its runtime drains)"


@dataclasses.dataclass
class FleetPlan(Plan):
    """The InferenceNode planner's :class:`~.plan.Plan` (``children`` are InferenceNodes, ``removals``
    name InferenceNodes) plus what only a fleet needs: ``scale_to``, written into spec.replicas before
    anything else; ``needs_nodes``: plan again with the Nodes read."""

    scale_to: int | None = None
    needs_nodes: bool = False

    @property
    def writes(self) -> bool:
        """Whether applying it changes any object but the fleet's own status."""
        return bool(self.children or self.removals or self.scale_to is not None)


# ====================================================================== facts
def parse_time(value: Any) -> float | None:
    """RFC 3339 (as Kubernetes and the runtimes write it) to Unix seconds; None when absent or bad."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def child_name(fleet_name: str, node_name: str) -> str:
    """``<fleet>-<node>``, hashed down to fit an object name (253) when both are long."""
    name = f"{fleet_name}-{node_name}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:242].rstrip('-.')}-{digest}"


def template_hash(spec: Mapping[str, Any]) -> str:
    """Digest of what the fleet copies into its InferenceNodes (a change of it is a rollout)."""
    template = {k: spec[k] for k in TEMPLATE_FIELDS if k in spec}
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def owned_by(fleet: Mapping[str, Any], inode: Mapping[str, Any]) -> bool:
    uid = fleet["metadata"].get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid
               for ref in (inode.get("metadata") or {}).get("ownerReferences") or ())


def _node_gpus(node: Mapping[str, Any]) -> int | None:
    status = node.get("status") or {}
    for source in (status.get("allocatable") or {}, status.get("capacity") or {},
                   {"nvidia.com/gpu": ((node.get("metadata") or {}).get("labels") or {}).get("nvidia.com/gpu.count")}):
        value = source.get("nvidia.com/gpu")
        if value is not None and str(value).isdigit():
            return int(value)
    return None


def node_matches(spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is one the fleet may place on (selector, GPU type and count, schedulable)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    gpu_type = spec.get("gpuType")
    if gpu_type and next((labels[k] for k in GPU_TYPE_LABELS if k in labels), None) != gpu_type:
        return False
    count = spec.get("gpuCount")
    if count:
        gpus = _node_gpus(node)
        if gpus is None or gpus < int(count):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Member:
    """One owned InferenceNode as the planner sees it."""

    name: str
    node: str
    ready: bool
    fresh: bool  # a heartbeat newer than its staleness bound
    serving: bool  # ready, fresh, admitting and listing every model of the fleet
    load: Mapping[str, Any]
    updated: bool  # its template hash is the fleet's current one
    deleting: bool
    lost: bool = False  # its Node is gone (NodeFound=False, NodeMissing): replaced like a pod of a deleted Node
    rolls_pod: bool = True  # outdated, and the fleet's template would change its runtime pod (not only live settings)

    @property
    def current(self) -> bool:
        """Runs the fleet's template, or differs from it only in what the runtime takes live."""
        return self.updated or not self.rolls_pod

    @property
    def drained(self) -> bool:
        """No stream to lose: idle at a fresh heartbeat, or no runtime gossiping at all."""
        if not self.fresh:
            return True
        return int(self.load.get("running", 0) or 0) == 0 and int(self.load.get("waiting", 0) or 0) == 0


def member(inode: Mapping[str, Any], models: Sequence[str], current_hash: str, now: float) -> Member:
    meta, spec, status = inode.get("metadata") or {}, inode.get("spec") or {}, inode.get("status") or {}
    stale_after = float(((spec.get("gossip") or {}).get("staleAfterSeconds")) or STALE_AFTER_S)
    beat = parse_time(status.get("lastHeartbeat"))
    fresh = beat is not None and now - beat <= stale_after
    ready = cond.is_true(status.get("conditions"), "Ready")
    serving = ready and fresh and bool(status.get("admitting")) and set(models) <= set(status.get("models") or ())
    return Member(name=meta.get("name", ""), node=spec.get("nodeName", ""), ready=ready, fresh=fresh,
                  serving=serving, load=status.get("load") or {},
                  updated=(meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) == current_hash,
                  deleting=bool(meta.get("deletionTimestamp")),
                  lost=(cond.find(status.get("conditions"), "NodeFound") or {}).get("reason") == "NodeMissing")


def rolls_pod(fleet: Mapping[str, Any], inode: Mapping[str, Any]) -> bool:
    """Whether writing the fleet's template into ``inode`` changes its runtime pod (the pod's config
    hash), rather than only what its runtime applies live."""
    node_name = (inode.get("spec") or {}).get("nodeName", "")
    wanted = build_inference_node(fleet, node_name)["spec"]
    return m.runtime_config_hash(wanted) != m.runtime_config_hash(inode.get("spec") or {})


def recorded_demand(inference_nodes: Sequence[Mapping[str, Any]], models: Sequence[str], now: float) -> int:
    """Requests for any of ``models`` that runtimes refused because they did not serve it, summed over
    every InferenceNode's gossiped ``status.demand`` entries last seen within :data:`DEMAND_WINDOW_S`."""
    wanted, total = set(models), 0
    for inode in inference_nodes:
        for entry in (inode.get("status") or {}).get("demand") or ():
            last = parse_time(entry.get("lastRequested"))
            if entry.get("model") in wanted and last is not None and now - last <= DEMAND_WINDOW_S:
                total += int(entry.get("requests", 0) or 0)
    return total


# ====================================================================== manifests
def build_inference_node(fleet: Mapping[str, Any], node_name: str) -> dict:
    """The InferenceNode the fleet keeps on ``node_name``: the fleet's template fields, its labels (so an
    operator running with ``--selector`` handles it too), and a controller owner reference."""
    meta, spec = fleet["metadata"], fleet.get("spec") or {}
    labels = {**(meta.get("labels") or {}), **m.MANAGED_BY, FLEET_LABEL: m.label_value(meta["name"])}
    child_spec: dict[str, Any] = {"nodeName": node_name, **{k: spec[k] for k in TEMPLATE_FIELDS if k in spec}}
    if spec.get("gpuType"):
        child_spec["gpuType"] = spec["gpuType"]
    return {
        "apiVersion": m.API_VERSION, "kind": "InferenceNode",
        "metadata": {"name": child_name(meta["name"], node_name), "labels": labels,
                     "annotations": {TEMPLATE_HASH_ANNOTATION: template_hash(spec),
                                     m.OWNER_NAME_ANNOTATION: f"{KIND}/{meta['name']}"},
                     "ownerReferences": [{**m.owner_reference(fleet), "blockOwnerDeletion": True}]},
        "spec": child_spec,
    }


def removed_now(plan: Plan) -> list[str]:
    return [r.name for r in plan.removals]


def selector_of(fleet: Mapping[str, Any]) -> str:
    """The owned InferenceNodes' label selector (status.selector, the scale subresource's)."""
    return f"{FLEET_LABEL}={m.label_value(fleet['metadata']['name'])}"


# ====================================================================== the plan
def _desired(fleet: Mapping[str, Any], members: Sequence[Member], demand: int, now: float,
             plan: FleetPlan) -> tuple[int, list[dict]]:
    """The replica count to run and the autoscaler's condition (none without spec.autoscaling)."""
    spec, status = fleet.get("spec") or {}, fleet.get("status") or {}
    replicas = int(spec.get("replicas", 1))
    scaling = spec.get("autoscaling")
    if not scaling:
        plan.status["desiredReplicas"] = replicas
        return replicas, []
    try:
        policy = autoscale.Policy.from_spec(scaling)
    except (ValueError, KeyError, TypeError) as exc:
        plan.invalid.append(f"spec.autoscaling: {exc}")
        return replicas, [cond.condition("AutoscalerActive", False, "InvalidPolicy", str(exc))]
    values = [autoscale.metric_value(x.load, policy.metric) for x in members if x.fresh and not x.deleting]
    history = autoscale.history_from_status(status.get("recommendations"), parse_time)
    decision = autoscale.decide(policy, values, replicas, history, now, demand)
    plan.status["desiredReplicas"] = decision.recommended
    plan.status["recommendations"] = [
        {"time": cond.timestamp(datetime.datetime.fromtimestamp(p.at, datetime.timezone.utc)),
         "replicas": p.replicas} for p in decision.history]
    if decision.replicas != replicas:
        plan.scale_to = decision.replicas
        plan.status["lastScaleTime"] = cond.timestamp(datetime.datetime.fromtimestamp(now, datetime.timezone.utc))
        why = "recorded demand" if decision.reason == "Demand" else decision.reason
        plan.notes.append(Note("Scaled", f"replicas {replicas} -> {decision.replicas} ({why}; "
                                         f"{policy.metric} {sum(values):g} over {len(values)} reporting, "
                                         f"target {policy.target:g} each, demand {demand})"))
    message = (f"recommends {decision.recommended} ({decision.reason}): {policy.metric} {sum(values):g} over "
               f"{len(values)} reporting InferenceNodes, target {policy.target:g}, demand {demand}")
    return decision.replicas, [cond.condition("AutoscalerActive", True, decision.reason, message)]


def _scale_down(members: Sequence[Member], excess: int, plan: FleetPlan) -> int:
    """Remove up to ``excess`` drained members (not-Ready first, then newest name); returns how many
    busy ones had to be kept."""
    newest_first = sorted(members, key=lambda x: x.name, reverse=True)
    order = sorted(newest_first, key=lambda x: (x.ready, x.serving))  # stable: keeps newest first within
    kept_busy = 0
    for x in order:
        if excess == 0:
            break
        if x.drained:
            plan.removals.append(Removal(m.API_VERSION, "InferenceNode", x.name, None, SCALED_DOWN))
            excess -= 1
        else:
            kept_busy += 1
    return min(kept_busy, excess)


def _owned_members(fleet: Mapping[str, Any], inference_nodes: Sequence[Mapping[str, Any]], models: Sequence[str],
                   t: float, plan: FleetPlan) -> list[Member]:
    """The fleet's live members; an InferenceNode whose Node is gone serves nothing and never will:
    it is removed (and placed anew by the caller)."""
    current_hash = template_hash(fleet.get("spec") or {})
    owned = {(x.get("metadata") or {}).get("name"): x for x in inference_nodes if owned_by(fleet, x)}
    members = sorted((member(x, models, current_hash, t) for x in owned.values()), key=lambda x: x.name)
    members = [x if x.updated else dataclasses.replace(x, rolls_pod=rolls_pod(fleet, owned[x.name]))
               for x in members]
    for x in members:
        if x.lost and not x.deleting:
            plan.removals.append(Removal(m.API_VERSION, "InferenceNode", x.name, None,
                                         f"its Node {x.node} is gone; replaced on another Node"))
    return [x for x in members if not x.deleting and not x.lost]


def _place(fleet: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]], inference_nodes: Sequence[Mapping[str, Any]],
           wanted: int, plan: FleetPlan) -> int:
    """New InferenceNodes on up to ``wanted`` free matching Nodes (name order); returns how many could
    not be placed."""
    spec = fleet.get("spec") or {}
    taken = {(x.get("spec") or {}).get("nodeName") for x in inference_nodes}
    free = sorted(n["metadata"]["name"] for n in nodes if n["metadata"]["name"] not in taken and node_matches(spec, n))
    for node_name in free[:wanted]:
        plan.children.append(build_inference_node(fleet, node_name))
    if plan.children:
        plan.notes.append(Note("Placing", f"creating {len(plan.children)} InferenceNode(s) on "
                                          f"{', '.join(c['spec']['nodeName'] for c in plan.children)}"))
    return wanted - min(wanted, len(free))


def rollout_knobs(fleet: Mapping[str, Any], plan: FleetPlan) -> tuple[int, int]:
    """``(maxSurge, maxUnavailable)`` of ``spec.rollout`` (defaults 0 and 1); both 0 is invalid."""
    rollout = (fleet.get("spec") or {}).get("rollout") or {}
    surge, unavailable = int(rollout.get("maxSurge", 0)), int(rollout.get("maxUnavailable", 1))
    if surge < 0 or unavailable < 0 or surge + unavailable == 0:
        plan.invalid.append(f"spec.rollout: maxSurge {surge} and maxUnavailable {unavailable}: give one above 0 "
                            "(with both 0 no InferenceNode could ever change)")
    return surge, unavailable


def _write_live(fleet: Mapping[str, Any], staying: Sequence[Member], plan: FleetPlan) -> None:
    """The template into every outdated member whose runtime takes the change live (no pod rolls)."""
    for x in staying:
        if not x.updated and not x.rolls_pod:
            plan.children.append(build_inference_node(fleet, x.node))


def _roll(fleet: Mapping[str, Any], staying: Sequence[Member], plan: FleetPlan) -> int:
    """Write the fleet's template into members whose pod it changes, in place, at most
    ``rollout.maxUnavailable`` Ready ones at a time; returns how many such members there are."""
    outdated = [x for x in staying if not x.current]
    max_unavailable = int(((fleet.get("spec") or {}).get("rollout") or {}).get("maxUnavailable", 1))
    budget = max(0, max_unavailable - sum(1 for x in staying if not x.ready))
    rolled = 0
    for x in outdated:
        # One that is not Ready costs no availability to change; a Ready one takes from the budget.
        if x.ready:
            if budget == 0:
                continue
            budget -= 1
        plan.children.append(build_inference_node(fleet, x.node))
        rolled += 1
    if rolled < len(outdated):
        plan.retry = plan.retry or Retry("rolling the fleet's change onto its InferenceNodes", DRAIN_RECHECK_S)
    return len(outdated)


def _surge(fleet: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None,
           inference_nodes: Sequence[Mapping[str, Any]], live: Sequence[Member], desired: int, surge: int,
           plan: FleetPlan) -> tuple[int, int] | None:
    """One step of a surging rollout: InferenceNodes with the new template on spare Nodes (at most
    ``desired + surge`` members in all), and the old ones retired (:func:`_retire`). With no spare
    Node and no surge under way, the change goes in place within ``maxUnavailable`` (:func:`_roll`).
    Returns (new InferenceNodes that could not be placed, created), or None when the Nodes must be read."""
    old = [x for x in live if not x.current]
    wanted = min(desired - (len(live) - len(old)), desired + surge - len(live))
    short = created = 0
    if wanted > 0:
        if nodes is None:
            return None
        before = len(plan.children)
        short = _place(fleet, nodes, inference_nodes, wanted, plan)
        created = len(plan.children) - before
        if created == 0 and len(live) <= desired:
            # No spare Node and no surge under way: in place, within maxUnavailable (0: wait for a Node).
            _roll(fleet, live, plan)
            if plan.children:
                plan.notes.append(Note("NoSpareNode", "no free matching Node to surge onto: rolling "
                                                      f"{len(plan.children)} in place within maxUnavailable"))
                return 0, 0
    _retire(old, live, desired, plan)
    plan.retry = plan.retry or Retry("surging the fleet's change onto spare Nodes", DRAIN_RECHECK_S)
    return short, created


def _retire(old: Sequence[Member], live: Sequence[Member], desired: int, plan: FleetPlan) -> None:
    """Delete old members while ``desired`` members, and ``desired`` Ready ones, remain without each:
    not-Ready ones first. A Ready old one therefore goes only once a new one is Ready; its runtime
    then drains (``runtime.drainSeconds``) as any deleted InferenceNode's does."""
    total, ready = len(live), sum(1 for x in live if x.ready)
    retired = []
    for x in sorted(old, key=lambda x: (x.ready, x.name)):
        if total - 1 < desired or (x.ready and ready - 1 < desired):
            continue
        plan.removals.append(Removal(m.API_VERSION, "InferenceNode", x.name, None, ROLLED_OUT))
        retired.append(x.name)
        total, ready = total - 1, ready - int(x.ready)
    if retired:
        plan.notes.append(Note("RolledOut", f"deleting {', '.join(retired)}: replaced by InferenceNodes with the "
                                            "fleet's new template"))


def _remove_excess(live: Sequence[Member], desired: int, plan: FleetPlan) -> None:
    if plan.removals:
        plan.notes.append(Note("Replacing", "; ".join(r.message.replace("its Node", f"{r.name}: Node", 1)
                                                      for r in plan.removals)))
    if len(live) <= desired:
        return
    kept_busy = _scale_down(live, len(live) - desired, plan)
    drained = [r.name for r in plan.removals if r.message.startswith(SCALED_DOWN)]
    if drained:
        plan.notes.append(Note("Removing", f"deleting drained InferenceNode(s) {', '.join(drained)}"))
    if kept_busy:
        plan.retry = Retry(f"{kept_busy} InferenceNode(s) to remove still have streams", DRAIN_RECHECK_S)


def plan_inference_fleet(fleet: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None,
                         inference_nodes: Sequence[Mapping[str, Any]], now: datetime.datetime) -> FleetPlan:
    """One reconcile of ``fleet`` decided from facts (see the module docstring).

    ``nodes``: the cluster's Nodes, or None when not read. ``inference_nodes``: every InferenceNode
    (owned ones are picked out by owner uid; the others mark their Nodes taken and carry demand)."""
    plan = FleetPlan()
    t = now.timestamp()
    models = [x.get("name") for x in (fleet.get("spec") or {}).get("models") or () if x.get("name")]
    if not models:
        plan.invalid.append("spec.models must name at least one model")
    # Each member would refuse it (InvalidSpec): refused once here, before any member is created.
    plan.invalid += validation.prefix_digest_problems(fleet.get("spec") or {})
    live = _owned_members(fleet, inference_nodes, models, t, plan)
    surge, _ = rollout_knobs(fleet, plan)
    demand = recorded_demand(inference_nodes, models, t)
    desired, auto_conditions = _desired(fleet, live, demand, t, plan)
    if plan.invalid:
        # Nothing is created, deleted or scaled for a spec a person must fix (the API server's schema
        # refuses most such specs before they get here).
        plan.scale_to, plan.phase = None, "Degraded"
        plan.conditions = [*auto_conditions, cond.condition("Ready", False, "InvalidSpec", "; ".join(plan.invalid))]
        return plan
    placed_short = new_children = 0
    if surge and any(not x.current for x in live):
        _remove_excess(live, len(live), plan)  # removes nothing: notes the replacement of lost ones
        step = _surge(fleet, nodes, inference_nodes, live, desired, surge, plan)
        if step is None:
            plan.needs_nodes = True
            return plan
        placed_short, new_children = step
    else:
        if len(live) < desired:
            if nodes is None:
                plan.needs_nodes = True
                return plan
            placed_short = _place(fleet, nodes, inference_nodes, desired - len(live), plan)
        new_children = len(plan.children)
        _remove_excess(live, desired, plan)
        _roll(fleet, [x for x in live if x.name not in {r.name for r in plan.removals}], plan)
    removed = {r.name for r in plan.removals}
    _write_live(fleet, [x for x in live if x.name not in removed], plan)
    outdated = sum(1 for x in live if not x.updated)
    placed = len(live) + new_children - sum(1 for r in plan.removals if r.message in (SCALED_DOWN, ROLLED_OUT))
    _report(plan, fleet, live, desired, demand, placed, placed_short,
            steady=len(live) == desired and not plan.children and not plan.removals and not outdated)
    plan.conditions[-1:-1] = auto_conditions  # NodesSelected, Scaled, AutoscalerActive, Ready
    if plan.phase == "Progressing" and plan.retry is None:
        plan.retry = Retry(plan.conditions[-1]["message"], 10.0)
    if placed_short:
        plan.retry = plan.retry or Retry("waiting for a free matching Node", 30.0)
    return plan


def _report(plan: FleetPlan, fleet: Mapping[str, Any], live: Sequence[Member], desired: int, demand: int,
            placed: int, placed_short: int, *, steady: bool) -> None:
    """The status fields, conditions and phase of a plan, from the members that stay and what was decided."""
    ready = sum(1 for x in live if x.ready)
    serving = sum(1 for x in live if x.serving)
    reporting = [x for x in live if x.fresh]
    kv = [float(x.load.get("kvCacheUsage", 0) or 0) for x in reporting]
    plan.status.update({
        "observedGeneration": fleet["metadata"].get("generation"),
        "replicas": len(live),
        "readyReplicas": ready,
        "servingReplicas": serving,
        "updatedReplicas": sum(1 for x in live if x.updated),
        "selector": selector_of(fleet),
        "nodes": sorted(x.node for x in live),
        "load": {"running": sum(int(x.load.get("running", 0) or 0) for x in reporting),
                 "waiting": sum(int(x.load.get("waiting", 0) or 0) for x in reporting),
                 "kvCacheUsage": round(sum(kv) / len(kv), 4) if kv else 0.0,
                 "demand": demand},
    })

    if placed_short:
        selected = cond.condition("NodesSelected", False, "NotEnoughNodes",
                                  f"{placed_short} more InferenceNode(s) wanted but no free Node matches "
                                  "nodeSelector/gpuType/gpuCount (a Node with any InferenceNode is taken)")
    else:
        selected = cond.condition("NodesSelected", True, "Placed",
                                  f"{placed} of {desired} InferenceNode(s) placed")
    scaled = cond.condition("Scaled", steady, "AtDesired" if steady else "Scaling",
                            f"{len(live)} InferenceNode(s), {desired} wanted")
    if desired == 0 and not live:
        phase, ready_cond = "Idle", cond.condition("Ready", True, "ScaledToZero",
                                                   "no InferenceNode wanted; a request for a model scales it up")
    elif placed_short and not live:
        phase, ready_cond = "Pending", cond.condition("Ready", False, "NoNodes", selected["message"])
    elif ready >= desired and steady:
        phase, ready_cond = "Ready", cond.condition("Ready", True, "AllReady", f"{ready} of {desired} Ready")
    elif placed_short:
        phase, ready_cond = "Degraded", cond.condition("Ready", False, "NotEnoughNodes", selected["message"])
    else:
        phase, ready_cond = "Progressing", cond.condition(
            "Ready", False, "Progressing", f"{len(live)} InferenceNode(s), {ready} Ready, {desired} wanted")
    plan.conditions = [selected, scaled, ready_cond]
    plan.phase = phase
