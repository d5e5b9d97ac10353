"""spec.runtime.engineArgs at admission: names checked against vLLM's (the shipped list, no vLLM
import in the operator), a typo is a status condition and an Event, and the runtime is not changed."""

from __future__ import annotations

import ast
import pathlib

import pytest

from zerolayer import vllm_args
from zerolayer.operator.errors import SpecError
from zerolayer.operator.validation import engine_args_problems

from .test_reconcile import conditions, current, world

REPO = pathlib.Path(__file__).resolve().parents[3]


def spec(models=None, **runtime):  # type: ignore[no-untyped-def]
    return {"nodeName": "n", "models": models or [{"name": "m", "source": {"path": "/m"}}], "runtime": runtime}


def test_valid_engine_args_pass():
    assert engine_args_problems(spec(gpus=2, engineArgs={"block_size": 32, "tensor_parallel_size": 2})) == []
    assert engine_args_problems(spec()) == []


@pytest.mark.parametrize("runtime, message", [
    ({"engineArgs": {"max_num_seq": 4}},
     f"spec.runtime.engineArgs.max_num_seq: not an engine argument of vLLM {vllm_args.VLLM_VERSION} "
     "(did you mean 'max_num_seqs'?)"),
    ({"engineArgs": {"served_model_name": "x"}}, "spec.runtime.engineArgs.served_model_name: set by zerolayer"),
    ({"maxNumSeqs": 8, "engineArgs": {"max_num_seqs": 4}},
     "spec.runtime.engineArgs.max_num_seqs: also set by spec.runtime.maxNumSeqs"),
    # the CRD defaults gpuMemoryUtilization, so the typed field always owns the fraction
    ({"gpuMemoryUtilization": 0.9, "engineArgs": {"gpu_memory_utilization": 0.5}},
     "also set by spec.runtime.gpuMemoryUtilization"),
    ({"gpus": 2, "engineArgs": {"tensor_parallel_size": 4}}, "= 4 GPUs, but the pod gets 2"),
    ({"gpus": 4, "engineArgs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}}, "= 6 GPUs"),
    ({"engineArgs": {"tensor_parallel_size": "2"}}, "must be positive integers"),
])
def test_engine_args_problems_name_the_field(runtime, message):
    problems = engine_args_problems(spec(**runtime))
    assert any(message in p for p in problems), problems


def test_max_model_len_belongs_to_the_model_when_it_sets_one():
    models = [{"name": "m", "source": {"path": "/m"}, "maxModelLen": 4096}]
    [problem] = engine_args_problems(spec(models, engineArgs={"max_model_len": 2048}))
    assert "also set by spec.models[m].maxModelLen" in problem
    assert engine_args_problems(spec(engineArgs={"max_model_len": 2048})) == []


def test_operator_never_imports_vllm():
    for path in (REPO / "operator" / "zerolayer" / "operator").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n == "vllm" or n.startswith("vllm.") for n in names), path.name
    for path in (REPO / "zerolayer" / "engine_args.py", REPO / "zerolayer" / "vllm_args.py"):
        assert "import vllm" not in path.read_text() and "from vllm" not in path.read_text()


async def test_a_typo_is_a_condition_and_an_event_and_leaves_the_runtime_alone():
    kube, rec, inode = world()
    await rec.reconcile_inference_node(inode)  # a good spec: the runtime DaemonSet exists
    daemonset = kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")
    before = repr(daemonset)
    bad = current(kube)
    bad = {**bad, "metadata": {**bad["metadata"], "generation": 4},
           "spec": {**bad["spec"], "runtime": {"engineArgs": {"enable_prefix_cache": True}}}}
    with pytest.raises(SpecError, match="did you mean 'enable_prefix_caching'"):
        await rec.reconcile_inference_node(bad)
    ready = conditions(current(kube))["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidEngineArgs"
    assert "enable_prefix_cache" in ready["message"] and current(kube)["status"]["phase"] == "Degraded"
    events = [e for e in kube.events if e[2] == "InvalidEngineArgs"]
    assert events and events[-1][4] is True and "enable_prefix_caching" in events[-1][3]
    assert repr(kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run")) == before
