"""Checks the CRD schema cannot express (cross-field rules), plus the basics again.

The API server already enforces the schemas in crds/; repeating the required basics here
keeps the operator from acting on an object admitted under an older CRD. Each function
returns a list of problems in plain words (empty means valid).
"""

from __future__ import annotations

from typing import Any, Mapping

from zerolayer import engine_args
from zerolayer import models as model_layout

PRIORITIES = ("high", "normal", "low")


def inference_node_problems(spec: Mapping[str, Any]) -> list[str]:
    problems = []
    if not spec.get("nodeName"):
        problems.append("spec.nodeName is required")
    models = spec.get("models") or []
    if not models:
        problems.append("spec.models must list at least one model")
    names = [m.get("name") for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"spec.models names must be unique, repeated: {', '.join(duplicates)}")
    defaults = [m.get("name") for m in models if m.get("default")]
    if len(defaults) > 1:
        problems.append(f"only one model may be the default, found {len(defaults)}: {', '.join(defaults)}")
    for m in models:
        lighter = m.get("lighterModel")
        if lighter and lighter not in names:
            problems.append(f"model {m.get('name')!r} falls back to {lighter!r}, which this node does not serve")
        if lighter and lighter == m.get("name"):
            problems.append(f"model {m.get('name')!r} names itself as its lighter model")
    problems += model_engine_problems(spec)
    sched = spec.get("scheduler") or {}
    resume, memory, normal = (sched.get(k) for k in ("resumeThreshold", "memoryThreshold", "normalThreshold"))
    if resume is not None and memory is not None and not resume < memory:
        problems.append("scheduler.resumeThreshold must be below scheduler.memoryThreshold")
    if normal is not None and memory is not None and normal < memory:
        problems.append("scheduler.normalThreshold must be at or above scheduler.memoryThreshold")
    gossip = spec.get("gossip") or {}
    heartbeat, stale = gossip.get("heartbeatSeconds"), gossip.get("staleAfterSeconds")
    if heartbeat is not None and stale is not None and stale <= heartbeat:
        problems.append(f"gossip.staleAfterSeconds ({stale}) must exceed gossip.heartbeatSeconds ({heartbeat}), "
                        "or every node would look stale between two heartbeats")
    return problems


def model_engine_problems(spec: Mapping[str, Any]) -> list[str]:
    """Several models and LoRA adapters: every served name (models and adapters) is unique, and the
    models' ``gpus`` fit the pod's ``spec.runtime.gpus`` (:func:`zerolayer.models.gpu_plan`)."""
    models = [m for m in spec.get("models") or () if isinstance(m, Mapping)]
    problems = []
    model_names = [m.get("name") for m in models]
    adapters = [a.get("name") for m in models for a in m.get("loras") or () if isinstance(a, Mapping)]
    served = model_names + adapters
    repeated = sorted({str(n) for n in adapters if served.count(n) > 1})  # model repeats are reported above
    if repeated:
        problems.append(f"adapter names must differ from every other model and adapter name on the node, "
                        f"repeated: {', '.join(repeated)}")
    runtime = spec.get("runtime") or {}
    if runtime.get("engine", "vllm") != "vllm":
        return problems
    try:
        model_layout.gpu_plan(models, int(runtime.get("gpus", 1)))
    except model_layout.GpuPlanError as exc:
        problems.append(str(exc))
    return problems


# spec.runtime's typed engine fields -> the vLLM argument each sets (runtime/incluster.py maps them).
TYPED_ENGINE_FIELDS = {"kvCacheBytes": "kv_cache_memory_bytes", "gpuMemoryUtilization": "gpu_memory_utilization",
                       "maxNumSeqs": "max_num_seqs", "maxNumBatchedTokens": "max_num_batched_tokens",
                       "dtype": "dtype", "enforceEager": "enforce_eager", "quantization": "quantization",
                       "enablePrefixCaching": "enable_prefix_caching"}


def engine_args_problems(spec: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``spec.runtime.engineArgs`` (reason InvalidEngineArgs); empty when valid.

    Names are checked against vLLM's own (the list shipped in zerolayer/vllm_args.py: the operator
    never imports vLLM); a typo names the closest valid argument. A name a typed field also sets
    is refused (``gpuMemoryUtilization`` has a default, so ``gpu_memory_utilization`` always is),
    and so is a parallel layout needing more GPUs than an engine gets. A model's ``toolCallParser``
    that vLLM does not have is refused here too.
    """
    runtime = spec.get("runtime") or {}
    parsers = [engine_args.tool_parser_problem(m.get("toolCallParser"), f"spec.models[{m.get('name')}].toolCallParser")
               for m in spec.get("models") or () if isinstance(m, Mapping)]
    problems = [p for p in parsers if p]
    args = runtime.get("engineArgs")
    if not args:
        return problems
    typed = {arg: f"spec.runtime.{field}" for field, arg in TYPED_ENGINE_FIELDS.items()
             if runtime.get(field) is not None}
    models = spec.get("models") or [{}]
    for model in models:
        if model.get("maxModelLen"):
            typed["max_model_len"] = f"spec.models[{model.get('name')}].maxModelLen"
    problems += engine_args.problems(args, "spec.runtime.engineArgs", typed)
    if problems or not isinstance(args, Mapping):
        return problems
    # Every engine takes engineArgs: the layout must fit the smallest engine's GPUs.
    gpus = max(1, min([int(m["gpus"]) for m in models if m.get("gpus")] or [int(runtime.get("gpus", 1))]))
    layout = [args.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in layout):
        problems.append(f"spec.runtime.engineArgs: tensor_parallel_size and pipeline_parallel_size must be positive "
                        f"integers, got {layout}")
    elif layout[0] * layout[1] > gpus:
        problems.append(f"spec.runtime.engineArgs: tensor_parallel_size x pipeline_parallel_size = "
                        f"{layout[0] * layout[1]} GPUs, but the pod gets {gpus} (spec.runtime.gpus)")
    return problems


def tenant_quota_problems(spec: Mapping[str, Any]) -> list[str]:
    problems = []
    if not spec.get("tenant"):
        problems.append("spec.tenant is required")
    if not (spec.get("apiKeySecretRef") or {}).get("name"):
        problems.append("spec.apiKeySecretRef.name is required")
    if not spec.get("namespaces"):
        problems.append("spec.namespaces must list at least one namespace")
    for field in ("tokensPerMinute", "requestsPerMinute"):
        value = spec.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"spec.{field} must be a positive integer, got {value!r}")
    streams = spec.get("maxConcurrentStreams")
    if streams is not None and (not isinstance(streams, int) or streams < 1):
        problems.append(f"spec.maxConcurrentStreams must be a positive integer, got {streams!r}")
    unknown = [p for p in spec.get("allowedPriorities") or () if p not in PRIORITIES]
    if unknown:
        problems.append(f"spec.allowedPriorities has unknown values {unknown}: use high, normal, low")
    return problems
