"""Pure planning of the per-model endpoints: one ClusterIP Service per model name, and optionally one
Gateway API Inference Extension ``InferencePool``, over every runtime pod that serves the model.

Facts in (every InferenceNode, the model Services and pools that exist), a :class:`~.plan.Plan` out
(children to create or patch, removals); no I/O, no clock, no kube imports (``.importlinter``).

**Per model name, not per InferenceFleet.** A client asks for a model by name; every runtime that
serves that name can answer, whether a fleet made its InferenceNode or a person wrote it. So the
Service ``zl-model-<name>`` selects the runtime pods labelled ``model.zerolayer.io/<name>: served``
(:func:`~.manifests.model_labels`, on every runtime pod template). Two fleets serving one name share
one Service, which is what a client of that name wants.

**Ownership.** The Service (and pool) carry a non-controller owner reference to every InferenceNode
that serves the model, so the garbage collector deletes them when the last of those goes even if the
operator is not running; while it runs, this planner also removes them as soon as no InferenceNode
(not being deleted) names the model any more.

**Base models only.** ``spec.models[].name``: a LoRA adapter's name (``models[].loras[]``) is served
by the pods of its base model, but not necessarily by all of them, so it gets no Service of its own.
"""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Any, Mapping, Sequence

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.plan import Note, Plan, Removal

SERVICE_PREFIX = "zl-model-"
MODEL_SERVICE_LABEL = "zerolayer.io/model-service"  # on the Service and pool: the model (label-safe)
MODEL_ANNOTATION = "zerolayer.io/model"  # the model's exact name
POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_CRD = "inferencepools.inference.networking.k8s.io"
POOL_MAX_PORTS = 8  # the CRD's targetPorts maxItems
_DNS = re.compile(r"[^a-z0-9-]+")


def model_service_name(model: str) -> str:
    """``zl-model-<name>`` as a DNS-1035 label (lowercase, '-', at most 63): a name that had to be
    changed to fit gets 8 hex digits of its hash, so two models never share a Service."""
    cleaned = _DNS.sub("-", model.lower()).strip("-") or "model"
    if cleaned == model and len(SERVICE_PREFIX) + len(cleaned) <= 63:
        return SERVICE_PREFIX + cleaned
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{SERVICE_PREFIX}{cleaned[: 63 - len(SERVICE_PREFIX) - 9].rstrip('-')}-{digest}"


def _ports(inodes: Sequence[Mapping[str, Any]], config: OperatorConfig) -> list[int]:
    return sorted({int(((x.get("spec") or {}).get("runtime") or {}).get("port") or config.runtime_port)
                   for x in inodes})


def _meta(model: str, inodes: Sequence[Mapping[str, Any]], config: OperatorConfig) -> dict:
    """Named for the model, owned (not controlled) by every InferenceNode serving it."""
    return {
        "name": model_service_name(model),
        "namespace": config.runtime_namespace,
        "labels": {**m.MANAGED_BY, MODEL_SERVICE_LABEL: m.label_value(model)},
        "annotations": {MODEL_ANNOTATION: model},
        "ownerReferences": [{**m.owner_reference(x), "controller": False}
                            for x in sorted(inodes, key=lambda x: x["metadata"]["name"])],
    }


def build_model_service(model: str, inodes: Sequence[Mapping[str, Any]], config: OperatorConfig) -> dict:
    """The model's one stable endpoint: ``zl-model-<name>.<namespace>.svc:<runtime port>``.

    A plain ClusterIP Service: kube-proxy (or the CNI's replacement) balances *connections* in the
    kernel, with no proxy in the path. The target is the named ``serving`` port, so each pod is
    reached on its own port (``spec.runtime.port`` may differ per InferenceNode) and the runtime
    NetworkPolicies, which admit that port name, admit the Service's traffic unchanged."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(model, inodes, config),
        "spec": {
            "type": "ClusterIP",
            "selector": {m.APP_LABEL: m.RUNTIME_APP, **m.model_labels([model])},
            "ports": [{"name": "http", "port": config.runtime_port, "targetPort": m.SERVING_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def build_inference_pool(model: str, inodes: Sequence[Mapping[str, Any]], config: OperatorConfig) -> dict:
    """The model's ``InferencePool`` (inference.networking.k8s.io/v1) for a gateway with an Endpoint
    Picker: the same pods, on the ports they serve on; ``endpointPickerRef`` when the operator was
    told which EPP Service to name (``inference_pool_epp``, ``{pool}`` replaced by the pool's name)."""
    name = model_service_name(model)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {m.APP_LABEL: m.RUNTIME_APP, **m.model_labels([model])}},
        "targetPorts": [{"number": p} for p in _ports(inodes, config)[:POOL_MAX_PORTS]],
    }
    if config.inference_pool_epp:
        spec["endpointPickerRef"] = {"name": config.inference_pool_epp.replace("{pool}", name),
                                     "port": {"number": config.inference_pool_epp_port}}
    return {"apiVersion": POOL_API_VERSION, "kind": "InferencePool", "metadata": _meta(model, inodes, config),
            "spec": spec}


def served_models(inodes: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Model name -> the InferenceNodes (not being deleted) that name it in ``spec.models``."""
    out: dict[str, list[Mapping[str, Any]]] = collections.defaultdict(list)
    for inode in inodes:
        if (inode.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for model in m.base_model_names(inode.get("spec") or {}):
            out[model].append(inode)
    return dict(out)


def plan_model_endpoints(inodes: Sequence[Mapping[str, Any]], services: Sequence[Mapping[str, Any]],
                         pools: Sequence[Mapping[str, Any]], config: OperatorConfig, *, pools_wanted: bool) -> Plan:
    """Every served model's Service (and pool when ``pools_wanted``: ``inference_pools`` is on and the
    pool CRD is installed); removals for existing ones whose model nobody serves now (every pool when
    pools are not wanted).

    ``services`` and ``pools``: the objects labelled :data:`MODEL_SERVICE_LABEL` in the runtime
    namespace. A model whose InferenceNodes use more ports than a pool may list is noted."""
    plan = Plan()
    wanted = served_models(inodes)
    for model, serving in sorted(wanted.items()):
        plan.children.append(build_model_service(model, serving, config))
        if pools_wanted:
            plan.children.append(build_inference_pool(model, serving, config))
            if len(_ports(serving, config)) > POOL_MAX_PORTS:
                plan.notes.append(Note("PoolPortsTruncated", f"model {model}: its InferenceNodes serve on more than "
                                       f"{POOL_MAX_PORTS} ports; the InferencePool lists the first {POOL_MAX_PORTS}",
                                       warning=True))
    names = {model_service_name(x) for x in wanted}
    for kind, api_version, existing, keep in (("Service", "v1", services, names),
                                              ("InferencePool", POOL_API_VERSION, pools, names if pools_wanted else set())):
        for obj in existing:
            meta = obj.get("metadata") or {}
            if meta.get("name") not in keep:
                gone = (meta.get("annotations") or {}).get(MODEL_ANNOTATION, meta.get("name"))
                why = f"no InferenceNode serves model {gone} now" if meta.get("name") not in names \
                    else "InferencePools are off (inference_pools) or their CRD is not installed"
                plan.removals.append(Removal(api_version, kind, meta["name"], meta.get("namespace"), why))
    return plan
