"""The deployed auditor gets the GPUs' power and the electricity price (issue 27): before, its
arguments named neither, so ``status.usage.cost`` never had the energy part docs/audit.md shows."""

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")


def auditor(node_gpus, **spec):
    body = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "gpu-node-0", "uid": "u-1", "generation": 1},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "tiny", "source": "/m"}], **spec}}
    ds = m.build_daemonset(body, CONFIG, node_gpus=node_gpus)
    return {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}["auditor"]


def env(container):
    return {e["name"]: e.get("value") for e in container["env"]}


def test_a_runtime_holding_every_gpu_bills_their_power_at_the_nodes_price():
    a = auditor(8, runtime={"gpus": 8}, audit={"electricityPricePerKWh": "0.31"})
    assert "--gpu-source=auto" in a["args"] and "--energy-price-per-kwh=0.31" in a["args"]
    assert "--tenant-quotas" in a["args"]  # the price applies with the TenantQuotas' prices
    assert env(a)["NVIDIA_VISIBLE_DEVICES"] == "all" and env(a)["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_the_crd_default_price_when_the_spec_names_none():
    assert "--energy-price-per-kwh=0.15" in auditor(1)["args"]


def test_no_nvml_when_the_runtime_holds_part_of_the_node_or_the_node_has_no_gpu():
    for a in (auditor(8, runtime={"gpus": 2}), auditor(None), auditor(0, runtime={"gpus": 0})):
        assert "--gpu-source=none" in a["args"]  # other pods' GPUs would be billed here
        assert "NVIDIA_VISIBLE_DEVICES" not in env(a)


def test_a_new_price_rolls_the_pod_since_the_auditor_reads_it_at_start():
    assert m.runtime_config_hash({"audit": {"electricityPricePerKWh": "0.2"}}) != m.runtime_config_hash({})
