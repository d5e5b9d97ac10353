"""``spec.runtime.apiProcesses``: the runtime's number of API processes (its config's
``server.api_processes``). Explicit, or one per 4 requested CPU cores (1..8, 1 without a request);
always rendered into the config file the runtime lays its InferenceNode over; refused outside 1..64;
a change rolls the pod; a fleet passes it to its InferenceNodes."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
from fractions import Fraction

import pytest
import yaml

from zerolayer.operator import fleet_plan as fp
from zerolayer.operator import manifests as m
from zerolayer.operator import plan as p
from zerolayer.operator import runtime_config as rc
from zerolayer.operator import validation
from zerolayer.operator.config import OperatorConfig

REPO = pathlib.Path(__file__).resolve().parents[3]
CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")
NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)


def inode(**runtime):
    return {"apiVersion": m.API_VERSION, "kind": "InferenceNode",
            "metadata": {"name": "gpu-node-0", "uid": "u-1", "generation": 1},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "tiny", "source": "/m"}],
                     **({"runtime": runtime} if runtime else {})}}


def cpu(request):
    return {"resources": {"requests": {"cpu": request}}}


def template(body, config=CONFIG):
    return m.build_daemonset(body, config, node_gpus=1)["spec"]["template"]


def rendered(body, config=CONFIG):
    """The config file the server container reads: the pod annotation its downward-API volume holds."""
    return yaml.safe_load(template(body, config)["metadata"]["annotations"][m.RUNTIME_CONFIG_ANNOTATION])


def server(body, config=CONFIG):
    return next(c for c in template(body, config)["spec"]["containers"] if c["name"] == "server")


# --------------------------------------------------------------------------- the default
@pytest.mark.parametrize("request_, processes", [
    ("500m", 1), ("1", 1), ("4", 1), ("7.9", 1), ("8", 2), ("12", 3), ("16", 4), ("31", 7), ("32", 8),
    ("64", 8), ("1000", 8), ("8000m", 2), ("0", 1), (None, 1),
])
def test_the_default_is_one_process_per_four_requested_cores_from_one_to_eight(request_, processes):
    cores = None if request_ is None else rc.parse_quantity(request_)
    assert rc.default_api_processes(cores) == processes
    body = inode(**({} if request_ is None else cpu(request_)))
    if request_ is None:  # no request at all: neither the spec's nor the operator's
        assert rendered(body, OperatorConfig(runtime_resources={"requests": {"memory": "16Gi"}})) == \
            {"server": {"api_processes": 1}}
    else:
        assert rendered(body) == {"server": {"api_processes": processes}}


def test_the_chart_default_request_gives_one_and_the_operators_resources_count():
    assert CONFIG.runtime_resources["requests"]["cpu"] == "4"
    assert rendered(inode()) == {"server": {"api_processes": 1}}
    big = OperatorConfig(runtime_resources={"requests": {"cpu": "24", "memory": "16Gi"}})
    assert rendered(inode(), big) == {"server": {"api_processes": 6}}
    assert rendered(inode(**cpu("8")), big) == {"server": {"api_processes": 2}}  # the spec's request wins


def test_a_limit_without_a_request_is_the_request():
    # Kubernetes gives a container with only a CPU limit a request equal to it.
    assert rc.cpu_request_cores({"limits": {"cpu": "16"}}) == 16
    assert rc.cpu_request_cores({"requests": {"cpu": "8"}, "limits": {"cpu": "16"}}) == 8
    assert rc.cpu_request_cores({"requests": {"memory": "1Gi"}}) is None
    assert rc.cpu_request_cores(None) is None
    assert rc.cpu_request_cores({"requests": {"cpu": "lots"}}) is None  # the API server refuses that pod
    no_cpu = OperatorConfig(runtime_resources={"requests": {"memory": "16Gi"}})
    assert rendered(inode(resources={"limits": {"cpu": "16"}}), no_cpu) == {"server": {"api_processes": 4}}


@pytest.mark.parametrize("text, value", [
    ("500m", Fraction(1, 2)), ("4", 4), ("1.5", Fraction(3, 2)), (".5", Fraction(1, 2)), ("2k", 2000),
    ("1Ki", 1024), ("1e3", 1000), ("250000u", Fraction(1, 4)), ("+3", 3), (8, 8), (0.25, Fraction(1, 4)),
])
def test_kubernetes_quantities(text, value):
    assert rc.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "m", "4 cores", "1x", "1e1.5", True])
def test_not_quantities(text):
    with pytest.raises(ValueError):
        rc.parse_quantity(text)


def two_models(**runtime):
    body = inode(**runtime)
    body["spec"]["models"] = [{"name": "a", "source": "/a"}, {"name": "b", "source": "/b"}]
    return body


def test_several_vllm_models_take_api_processes_like_one():
    """The runtime serves several models with one vLLM engine each (engines:), and its API processes
    share one engine core per model: the number defaults from the CPU request and any 1..64 is taken."""
    assert rendered(two_models(**cpu("64"))) == {"server": {"api_processes": 8}}
    assert rendered(two_models(**cpu("8"))) == {"server": {"api_processes": 2}}
    assert validation.inference_node_problems(two_models(apiProcesses=1)["spec"]) == []
    assert validation.inference_node_problems(two_models(**cpu("64"))["spec"]) == []
    assert validation.inference_node_problems(two_models(apiProcesses=2)["spec"]) == []
    assert rendered(two_models(apiProcesses=3)) == {"server": {"api_processes": 3}}
    [problem] = validation.inference_node_problems(two_models(apiProcesses=65)["spec"])
    assert problem.startswith("spec.runtime.apiProcesses must be an integer from 1 to 64")
    # The synthetic engine serves every model from one engine.
    assert rendered(two_models(engine="synthetic", **cpu("16"))) == {"server": {"api_processes": 4}}
    assert validation.inference_node_problems(two_models(engine="synthetic", apiProcesses=4)["spec"]) == []
    # One model with GPUs of its own is still one engine.
    one = inode(**cpu("16"))
    one["spec"]["models"][0]["gpus"] = 1
    assert rendered(one) == {"server": {"api_processes": 4}}


# --------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("processes", [1, 3, 12, 64])
def test_an_explicit_number_is_rendered_whatever_the_cpu_request(processes):
    assert rendered(inode(apiProcesses=processes, **cpu("64"))) == {"server": {"api_processes": processes}}
    assert rc.runtime_config({"runtime": {"apiProcesses": processes}}, None) == \
        {"server": {"api_processes": processes}}


def test_the_server_reads_the_rendered_file_laid_under_its_inference_node():
    body = inode(apiProcesses=5)
    pod = template(body)["spec"]
    c = server(body)
    assert c["args"][:2] == ["runtime", "--node-name=gpu-node-0"]
    assert "--in-cluster" in c["args"] and f"--config={m.RUNTIME_CONFIG_FILE}" in c["args"]
    assert {"name": "runtime-config", "mountPath": m.RUNTIME_CONFIG_MOUNT, "readOnly": True} in c["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == "runtime-config")
    [item] = volume["downwardAPI"]["items"]
    assert f"{m.RUNTIME_CONFIG_MOUNT}/{item['path']}" == m.RUNTIME_CONFIG_FILE
    assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{m.RUNTIME_CONFIG_ANNOTATION}']"
    text = template(body)["metadata"]["annotations"][m.RUNTIME_CONFIG_ANNOTATION]
    assert json.loads(text) == yaml.safe_load(text) == {"server": {"api_processes": 5}}


def test_the_runtime_takes_those_flags_and_keeps_the_key_beside_server_core():
    """The runtime side of the contract that exists today: its CLI parses the server's arguments, and
    config_from_inferencenode keeps the rendered server.api_processes when it sets server.core."""
    from zerolayer.runtime import cli as runtime_cli
    from zerolayer.runtime.node.incluster import config_from_inferencenode

    body = inode(apiProcesses=3, serverCore="native", engine="synthetic")
    parser = argparse.ArgumentParser()
    runtime_cli.register(parser.add_subparsers())
    args = parser.parse_args(server(body)["args"])
    assert args.in_cluster and args.config == m.RUNTIME_CONFIG_FILE and args.node_name == "gpu-node-0"
    base = rendered(body)
    assert config_from_inferencenode(body, base)["server"] == {"api_processes": 3, "core": "native"}


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("value", [0, -1, 65, 1000, 2.5, "4", True, [2]])
def test_out_of_range_or_non_integer_is_refused_naming_the_field(value):
    problems = validation.inference_node_problems(inode(apiProcesses=value)["spec"])
    assert problems == [f"spec.runtime.apiProcesses must be an integer from 1 to 64, got {value!r}"]


@pytest.mark.parametrize("runtime", [{}, {"apiProcesses": 1}, {"apiProcesses": 64}, {"apiProcesses": 8, **cpu("2")}])
def test_unset_or_in_range_is_accepted(runtime):
    assert validation.inference_node_problems(inode(**runtime)["spec"]) == []


def test_a_refused_number_writes_no_pod_and_says_why():
    plan = p.plan_inference_node(p.InferenceNodeFacts(inode=inode(apiProcesses=0), config=CONFIG, now=NOW))
    assert plan.children == [] and plan.patches == []
    [ready] = [c for c in plan.conditions if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.runtime.apiProcesses must be an integer from 1 to 64, got 0" in ready["message"]


def test_the_crds_bound_it_like_the_operator_and_give_no_default():
    for path in ("crds/inferencenodes.zerolayer.io.yaml", "helm/zerolayer/crds/inferencenodes.zerolayer.io.yaml"):
        crd = yaml.safe_load((REPO / path).read_text())
        runtime = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["runtime"]
        field = runtime["properties"]["apiProcesses"]
        assert (field["type"], field["minimum"], field["maximum"]) == ("integer", rc.API_PROCESSES_MIN,
                                                                      rc.API_PROCESSES_MAX), path
        assert "default" not in field, path  # absent means: computed from the CPU request
        assert "server.api_processes" in field["description"]


# --------------------------------------------------------------------------- rolling
def hash_of(body):
    return template(body)["metadata"]["annotations"][m.CONFIG_HASH_ANNOTATION]


@pytest.mark.parametrize("before, after", [
    ({}, {"apiProcesses": 2}),
    ({"apiProcesses": 2}, {"apiProcesses": 4}),
    ({"apiProcesses": 4}, {}),
    (cpu("8"), cpu("16")),  # the default goes 2 -> 4
])
def test_a_new_number_changes_the_restart_key_and_the_rendered_file(before, after):
    old, new = inode(**before), inode(**after)
    assert rendered(old) != rendered(new)
    assert m.runtime_config_hash(old["spec"]) != m.runtime_config_hash(new["spec"])
    assert hash_of(old) != hash_of(new)
    assert template(old) != template(new)


def test_the_operators_default_request_rolls_the_pod_through_the_rendered_file():
    small = OperatorConfig(runtime_resources={"requests": {"cpu": "4"}})
    large = OperatorConfig(runtime_resources={"requests": {"cpu": "32"}})
    body = inode()
    assert rendered(body, small) == {"server": {"api_processes": 1}}
    assert rendered(body, large) == {"server": {"api_processes": 8}}
    assert template(body, small)["metadata"]["annotations"] != template(body, large)["metadata"]["annotations"]


def test_a_live_setting_still_does_not_roll():
    body = inode(apiProcesses=2)
    live = copy.deepcopy(body)
    live["spec"]["scheduler"] = {"memoryThreshold": 0.8, "resumeThreshold": 0.7}
    assert hash_of(body) == hash_of(live) and rendered(body) == rendered(live)


# --------------------------------------------------------------------------- fleets
def fleet(**runtime):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": "llama", "uid": "uid-f", "generation": 3},
            "spec": {"replicas": 1, "nodeSelector": {"gpu": "yes"},
                     "models": [{"name": "tiny", "source": {"path": "/models/tiny"}}], "runtime": runtime}}


def test_a_fleet_passes_it_to_its_inference_nodes_and_a_change_rolls_their_pods():
    child = fp.build_inference_node(fleet(apiProcesses=6), "n1")
    assert child["spec"]["runtime"]["apiProcesses"] == 6
    assert rendered({**child, "metadata": {**child["metadata"], "uid": "u"}}) == {"server": {"api_processes": 6}}
    assert fp.rolls_pod(fleet(apiProcesses=4), child)
    assert not fp.rolls_pod(fleet(apiProcesses=6), child)
    assert fp.template_hash(fleet(apiProcesses=4)["spec"]) != fp.template_hash(fleet(apiProcesses=6)["spec"])


def test_the_fleet_crd_carries_the_same_field():
    crd = yaml.safe_load((REPO / "crds/inferencefleets.zerolayer.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    node = yaml.safe_load((REPO / "crds/inferencenodes.zerolayer.io.yaml").read_text())
    nspec = node["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["runtime"]["properties"]["apiProcesses"] == nspec["runtime"]["properties"]["apiProcesses"]


def test_the_crd_docs_list_it():
    docs = (REPO / "docs/crds.md").read_text()
    assert docs.count("| `spec.runtime.apiProcesses` | integer |") == 2  # InferenceFleet and InferenceNode
