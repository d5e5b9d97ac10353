"""Per-model endpoints (operator/zerolayer/operator/model_plan.py): one ClusterIP Service per served model
name, optionally one InferencePool, over the runtime pods labelled for that model; pure, no API server."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from zerolayer.operator import manifests as m
from zerolayer.operator import model_plan as mp
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import ConfigError

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op")
POOLS = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", inference_pools=True,
                       inference_pool_epp="{pool}-epp", inference_pool_epp_port=9002)
POOL_CRD = pathlib.Path(__file__).parents[3] / "crds/vendor/inference.networking.k8s.io_inferencepools.yaml"


def inode(name, *models, port=None, deleting=False, loras=()):
    spec = {"nodeName": f"gpu-{name}",
            "models": [{"name": x, "source": "/m", **({"loras": list(loras)} if loras else {})} for x in models]}
    if port:
        spec["runtime"] = {"port": port}
    meta = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": m.API_VERSION, "kind": "InferenceNode", "metadata": meta, "spec": spec}


def existing(kind, model):
    return {"kind": kind, "metadata": {"name": mp.model_service_name(model), "namespace": "zl-run",
                                       "annotations": {mp.MODEL_ANNOTATION: model},
                                       "labels": {mp.MODEL_SERVICE_LABEL: m.label_value(model)}}}


def test_runtime_pods_carry_a_label_per_base_model_and_the_service_selects_it():
    node = inode("a", "llama-3-8b", "qwen/Qwen2-7B", loras=[{"name": "sql", "source": "/l"}])
    labels = m.build_daemonset(node, CONFIG)["spec"]["template"]["metadata"]["labels"]
    service = mp.build_model_service("qwen/Qwen2-7B", [node], CONFIG)
    assert labels[m.model_label_key("llama-3-8b")] == m.MODEL_SERVED
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert not any("sql" in k for k in labels)  # an adapter: no label, no Service of its own


@pytest.mark.parametrize("model, key, service", [
    ("tiny", "model.zerolayer.io/tiny", "zl-model-tiny"),
    ("llama-3-8b", "model.zerolayer.io/llama-3-8b", "zl-model-llama-3-8b"),
])
def test_names_of_label_safe_models_are_kept(model, key, service):
    assert m.model_label_key(model) == key
    assert mp.model_service_name(model) == service


@pytest.mark.parametrize("a, b", [("qwen/Qwen2", "qwen-Qwen2"), ("Tiny", "tiny"), ("x" * 80, "x" * 81)])
def test_names_that_must_be_cleaned_never_collide_and_stay_valid(a, b):
    assert m.model_label_key(a) != m.model_label_key(b)
    assert mp.model_service_name(a) != mp.model_service_name(b)
    for name in (mp.model_service_name(a), mp.model_service_name(b)):
        assert len(name) <= 63 and name == name.lower() and name[0].isalpha() and name[-1].isalnum()
    for key in (m.model_label_key(a), m.model_label_key(b)):
        assert len(key.split("/", 1)[1]) <= 63


def test_the_service_is_clusterip_on_the_named_serving_port_and_owned_by_every_serving_node():
    nodes = [inode("b", "tiny", port=9000), inode("a", "tiny")]
    service = mp.build_model_service("tiny", nodes, CONFIG)
    assert service["spec"]["type"] == "ClusterIP" and "clusterIP" not in service["spec"]
    assert service["spec"]["ports"] == [{"name": "http", "port": CONFIG.runtime_port,
                                         "targetPort": m.SERVING_PORT_NAME, "protocol": "TCP"}]
    refs = service["metadata"]["ownerReferences"]
    assert [r["name"] for r in refs] == ["a", "b"] and not any(r["controller"] for r in refs)
    assert service["metadata"]["namespace"] == "zl-run"


def test_network_policies_admit_the_port_the_service_targets():
    """A ClusterIP Service is DNAT to the pod: policies see the pod's port, which tenants' and the
    operator's policies admit by the same name the Service targets."""
    node = inode("a", "tiny")
    target = mp.build_model_service("tiny", [node], CONFIG)["spec"]["ports"][0]["targetPort"]
    tenant = {"metadata": {"name": "t", "uid": "t"}, "kind": "TenantQuota", "spec": {"namespaces": ["apps"]}}
    policies = [m.build_runtime_networkpolicy(node, CONFIG), m.build_tenant_networkpolicy(tenant, CONFIG)]
    admitted = [p["port"] for pol in policies for rule in pol["spec"]["ingress"] for p in rule["ports"]]
    assert target in admitted
    pod_ports = [p["name"] for c in m.build_daemonset(node, CONFIG)["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports") or ()]
    assert target in pod_ports


def test_plan_makes_one_service_per_served_model_and_removes_unserved_ones():
    nodes = [inode("a", "tiny", "big"), inode("b", "tiny"), inode("c", "gone", deleting=True)]
    plan = mp.plan_model_endpoints(nodes, [existing("Service", "tiny"), existing("Service", "old")], [],
                                   CONFIG, pools_wanted=False)
    services = {c["metadata"]["name"]: c for c in plan.children}
    assert sorted(services) == ["zl-model-big", "zl-model-tiny"]
    assert [r["name"] for r in services["zl-model-tiny"]["metadata"]["ownerReferences"]] == ["a", "b"]
    assert [(r.kind, r.name) for r in plan.removals] == [("Service", "zl-model-old")]
    assert "old" in plan.removals[0].message


def test_pools_only_when_wanted_and_removed_when_not():
    nodes = [inode("a", "tiny")]
    on = mp.plan_model_endpoints(nodes, [], [existing("InferencePool", "old")], POOLS, pools_wanted=True)
    assert [c["kind"] for c in on.children] == ["Service", "InferencePool"]
    assert [(r.kind, r.name) for r in on.removals] == [("InferencePool", "zl-model-old")]
    off = mp.plan_model_endpoints(nodes, [], [existing("InferencePool", "tiny")], POOLS, pools_wanted=False)
    assert [c["kind"] for c in off.children] == ["Service"]
    assert [(r.kind, r.name) for r in off.removals] == [("InferencePool", "zl-model-tiny")]


def test_the_pool_selects_the_same_pods_on_their_ports_and_names_its_endpoint_picker():
    pool = mp.build_inference_pool("tiny", [inode("a", "tiny", port=9000), inode("b", "tiny")], POOLS)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == mp.build_model_service("tiny", [], POOLS)["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": 8443}, {"number": 9000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "zl-model-tiny-epp", "port": {"number": 9002}}
    assert "endpointPickerRef" not in mp.build_inference_pool("tiny", [inode("a", "tiny")], CONFIG)["spec"]


def test_the_pool_fits_the_vendored_crd_schema():
    """Required fields and types as the real CRD (crds/vendor/, from the Go module) states them; the
    e2e tier applies the pool to a real API server with that CRD."""
    crd = yaml.safe_load(POOL_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec = mp.build_inference_pool("tiny", [inode("a", "tiny")], POOLS)["spec"]
    assert set(schema["required"]) <= set(spec) and set(spec) <= set(schema["properties"])
    assert len(spec["targetPorts"]) <= schema["properties"]["targetPorts"]["maxItems"]
    assert f"{crd['spec']['group']}/{version['name']}" == mp.POOL_API_VERSION
    assert crd["metadata"]["name"] == mp.POOL_CRD


@pytest.mark.parametrize("kwargs", [{"inference_pool_epp": "Bad_Name"}, {"inference_pool_epp_port": 0}])
def test_bad_pool_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        OperatorConfig(**kwargs)


def test_pool_settings_come_from_the_charts_environment():
    config = OperatorConfig.from_env({"ZEROLAYER_INFERENCE_POOLS": "true", "ZEROLAYER_INFERENCE_POOL_EPP": "epp",
                                      "ZEROLAYER_INFERENCE_POOL_EPP_PORT": "9100"})
    assert (config.inference_pools, config.inference_pool_epp, config.inference_pool_epp_port) == (True, "epp", 9100)
