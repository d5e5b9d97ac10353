"""Several models and LoRA adapters on one InferenceNode: admission checks, the GPU plan, the
adapters' mounts in the runtime pod, and the runtime config the pod is given. No cluster."""

from __future__ import annotations

import pytest

from zerolayer import models as model_layout
from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.validation import engine_args_problems, inference_node_problems
from zerolayer.runtime.config import parse_config
from zerolayer.runtime.node.incluster import config_from_inferencenode

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")
BASE = {"name": "base", "source": {"hostPath": {"path": "/srv/base"}}, "default": True, "toolCallParser": "hermes",
        "loras": [{"name": "base-sql", "source": {"pvc": {"claimName": "adapters", "subPath": "sql"}}},
                  {"name": "base-hf", "source": {"huggingFace": {"repo": "org/lora", "revision": "r1"}}}]}
OTHER = {"name": "other", "source": {"hostPath": {"path": "/srv/other"}}}


def inode(models, **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "gpu-node-0", "uid": "u-1", "generation": 1},
            "spec": {"nodeName": "gpu-node-0", "models": models, **spec}}


def test_gpu_plan_gives_dedicated_gpus_in_order_and_shares_the_rest():
    plan = model_layout.gpu_plan([{"name": "a", "gpus": 2}, {"name": "b"}, {"name": "c", "gpus": 1}, {"name": "d"}], 8)
    assert plan == [((0, 1), 1), ((3, 4, 5, 6, 7), 2), ((2,), 1), ((3, 4, 5, 6, 7), 2)]
    assert model_layout.gpu_plan([{"name": "a"}, {"name": "b"}], 0) == [((), 1), ((), 1)]  # CPU: no devices
    with pytest.raises(model_layout.GpuPlanError, match="add up to 3, but the pod gets 2"):
        model_layout.gpu_plan([{"name": "a", "gpus": 2}, {"name": "b", "gpus": 1}], 2)


def test_admission_refuses_clashing_names_gpus_that_do_not_fit_and_unknown_parsers():
    clash = dict(OTHER, loras=[{"name": "base", "source": {"path": "/a"}}])
    problems = inference_node_problems(inode([BASE, clash])["spec"])
    assert any("repeated: base" in p for p in problems)
    greedy = inference_node_problems(inode([dict(BASE, gpus=1), OTHER], runtime={"gpus": 1})["spec"])
    assert greedy == ["no GPU is left for other: the other models take all 1 (give these models gpus, or the pod more)"]
    assert inference_node_problems(inode([dict(BASE, gpus=1), OTHER], runtime={"gpus": 2})["spec"]) == []
    typo = engine_args_problems(inode([dict(BASE, toolCallParser="hermez")])["spec"])
    assert len(typo) == 1 and "did you mean 'hermes'" in typo[0]


def test_adapters_are_mounted_and_downloaded_like_models_after_every_model():
    storage = m.build_model_storage(inode([BASE, OTHER])["spec"], "img:1", "IfNotPresent")
    mounts = {mt["mountPath"]: mt for mt in storage.server_mounts}
    # Models keep indexes 0 and 1 (adding adapters does not rename their volumes); adapters follow.
    assert mounts["/models/base"]["name"] == "model-0" and mounts["/models/other"]["name"] == "model-1"
    assert mounts["/models/base-sql"] == {"name": "model-2", "mountPath": "/models/base-sql", "readOnly": True,
                                          "subPath": "sql"}
    assert mounts["/models/base-hf"]["subPath"] == model_layout.cache_entry("org/lora", "r1")
    assert [c["name"] for c in storage.init_containers] == ["fetch-model-3"]
    assert m.model_claims(inode([BASE, OTHER])["spec"]) == ["adapters"]


def test_the_runtime_serves_every_model_with_its_adapters_and_parser():
    node = inode([OTHER, BASE], runtime={"engine": "vllm", "gpus": 2, "kvCacheBytes": 1 << 28})
    mapping = config_from_inferencenode(node)
    first, second = mapping["engines"]
    assert first["served_name"] == "base" and second["served_name"] == "other"  # the default first
    assert first["tool_parser"] == "hermes"
    assert first["loras"] == [{"name": "base-sql", "path": "/models/base-sql"},
                              {"name": "base-hf", "path": "/models/base-hf"}]
    assert first["gpus"] == second["gpus"] == [0, 1]  # neither asked for its own GPUs: they share both
    config = parse_config(mapping, base_dir=None, environ={})  # type: ignore[arg-type]
    assert len(config.engines) == 2
