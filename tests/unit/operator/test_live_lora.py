"""LoRA adapters are loaded in the running engine, not by rolling the pod (issue 25): an adapter the pod
already sees (a ``path`` source, or a hostPath under the node's adapters directory) changes nothing in
the runtime's DaemonSet; one that needs a volume, and LoRA turning on or off, do. The runtime reads
the same paths the operator mounts. No cluster."""

from __future__ import annotations

import copy

import pytest

from zerolayer import models as layout
from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.runtime.node.incluster import config_from_inferencenode, wanted_adapters

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")
UNDER = f"{layout.ADAPTERS_HOST_DIR}/team-a"


def node(*adapters: dict, **runtime) -> dict:
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "gpu-0", "uid": "u-1", "generation": 1},
            "spec": {"nodeName": "gpu-0", "runtime": {"engine": "vllm", **runtime},
                     "models": [{"name": "tiny", "source": {"hostPath": {"path": "/srv/tiny"}},
                                 "loras": list(adapters)}]}}


def template(inode: dict) -> dict:
    return m.build_daemonset(inode, CONFIG, node_gpus=1)["spec"]["template"]


def adapter(name: str, source: dict) -> dict:
    return {"name": name, "source": source}


SQL = adapter("tiny-sql", {"hostPath": {"path": f"{UNDER}/sql"}})
LIVE = [adapter("tiny-chat", {"hostPath": {"path": f"{UNDER}/chat"}}),
        adapter("tiny-baked", {"path": "/opt/adapters/baked"})]


@pytest.mark.parametrize("added", LIVE, ids=["hostPath-under-adapters-dir", "path-in-image"])
def test_adding_or_removing_a_live_adapter_leaves_the_pod_template_as_it_is(added):
    before = template(node(SQL))
    assert template(node(SQL, added)) == before
    assert template(node(added)) == template(node(SQL))  # removing SQL (and adding another) too


def test_lora_on_mounts_the_node_adapters_directory_read_only_and_no_volume_per_adapter():
    pod = template(node(SQL, LIVE[0]))["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == m.ADAPTERS_VOLUME]
    assert volume["hostPath"] == {"path": layout.ADAPTERS_HOST_DIR, "type": "DirectoryOrCreate"}
    server = next(c for c in pod["containers"] if c["name"] == "server")
    [mount] = [v for v in server["volumeMounts"] if v["name"] == m.ADAPTERS_VOLUME]
    assert mount == {"name": m.ADAPTERS_VOLUME, "mountPath": layout.ADAPTERS_HOST_DIR, "readOnly": True}
    assert not [v for v in pod["volumes"] if v["name"].startswith("model-") and "adapters" in str(v)]
    assert not any(v["name"] == m.ADAPTERS_VOLUME for v in template(node())["spec"]["volumes"])  # LoRA off


@pytest.mark.parametrize("change", ["first adapter", "last adapter removed", "adapter with its own volume",
                                    "adapter hostPath escaping the directory"])
def test_changes_the_running_engine_cannot_take_change_the_pod(change):
    outside = adapter("tiny-x", {"hostPath": {"path": "/srv/adapters/x"}})
    escaping = adapter("tiny-x", {"hostPath": {"path": f"{layout.ADAPTERS_HOST_DIR}/../models/x"}})
    before, after = {
        "first adapter": (node(), node(SQL)),
        "last adapter removed": (node(SQL), node()),
        "adapter with its own volume": (node(SQL), node(SQL, outside)),
        "adapter hostPath escaping the directory": (node(SQL), node(SQL, escaping)),
    }[change]
    assert template(after) != template(before)


def test_enable_lora_in_engine_args_makes_even_the_first_adapter_live():
    args = {"engineArgs": {"enable_lora": True, "max_lora_rank": 64}}
    assert template(node(**args)) == template(node(SQL, **args))


def test_the_runtime_reads_the_adapter_where_the_operator_mounts_it():
    inode = node(SQL, LIVE[1], adapter("tiny-pvc", {"pvc": {"claimName": "adapters", "subPath": "pvc"}}))
    config = config_from_inferencenode(copy.deepcopy(inode), {})
    assert wanted_adapters(config) == {"tiny": {"tiny-sql": f"{UNDER}/sql", "tiny-baked": "/opt/adapters/baked",
                                                "tiny-pvc": "/models/tiny-pvc"}}
    server = next(c for c in template(inode)["spec"]["containers"] if c["name"] == "server")
    assert "/models/tiny-pvc" in {v["mountPath"] for v in server["volumeMounts"]}  # the PVC one has its own


@pytest.mark.parametrize("path, under", [
    (f"{layout.ADAPTERS_HOST_DIR}/a", True), (f"{layout.ADAPTERS_HOST_DIR}/a/b/", True),
    (layout.ADAPTERS_HOST_DIR, False), (f"{layout.ADAPTERS_HOST_DIR}/", False),
    (f"{layout.ADAPTERS_HOST_DIR}/../x", False), (f"{layout.ADAPTERS_HOST_DIR}-evil/a", False), ("/srv/a", False),
])
def test_under_adapters_dir(path, under):
    assert layout.under_adapters_dir({"hostPath": {"path": path}}) is under
