"""Checks the CRD schema cannot express (cross-field rules), plus the basics again.

The API server already enforces the schemas in crds/; repeating the required basics here
keeps the operator from acting on an object admitted under an older CRD. Each function
returns a list of problems in plain words (empty means valid).
"""

from __future__ import annotations

from typing import Any, Mapping

from zerolayer import engine_args
from zerolayer import models as model_layout
from zerolayer.operator.manifests import AUDIT_METRICS_PORT
from zerolayer.operator.runtime_config import api_processes_problem

PRIORITIES = ("high", "normal", "low")
# spec.runtime.serverCore: the runtime's HTTP/2 core (its server.core; docs/server-core.md). Kept here,
# not imported from the runtime, so the operator does not load the runtime's config module.
SERVER_CORES = ("python", "native")


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
    problems += model_engine_problems(spec)
    problems += prefix_digest_problems(spec)
    sched = spec.get("scheduler") or {}
    resume, memory, normal = (sched.get(k) for k in ("resumeThreshold", "memoryThreshold", "normalThreshold"))
    if resume is not None and memory is not None and not resume < memory:
        problems.append("scheduler.resumeThreshold must be below scheduler.memoryThreshold")
    if normal is not None and memory is not None and normal < memory:
        problems.append("scheduler.normalThreshold must be at or above scheduler.memoryThreshold")
    core = (spec.get("runtime") or {}).get("serverCore", "native")
    if core not in SERVER_CORES:
        problems.append(f"spec.runtime.serverCore must be one of {', '.join(SERVER_CORES)}, got {core!r}")
    processes = api_processes_problem(spec)  # spec.runtime.apiProcesses: 1..64 or unset
    if processes:
        problems.append(processes)
    port = (spec.get("runtime") or {}).get("port")
    if port == AUDIT_METRICS_PORT and (spec.get("audit") or {}).get("enabled", True):
        problems.append(f"runtime.port {port} is the auditor's metrics port in the same pod; choose another")
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


def prefix_digest_problems(spec: Mapping[str, Any]) -> list[str]:
    """``spec.gossip.prefixDigestSource: kvEvents`` where it cannot work (reason InvalidSpec): the
    digest then follows vLLM's KV cache events, so it needs the vllm engine, with prefix caching on,
    and sets vLLM's ``kv_events_config`` itself. The runtime refuses the same at start (its
    ``engine.prefix_digest``); refused here first, the user reads it in the InferenceNode's conditions."""
    if (spec.get("gossip") or {}).get("prefixDigestSource") != "kvEvents":
        return []
    runtime = spec.get("runtime") or {}
    where = "spec.gossip.prefixDigestSource kvEvents"
    problems = []
    engine = runtime.get("engine", "vllm")
    if engine != "vllm":
        problems.append(f"{where} follows vLLM's KV cache events, but spec.runtime.engine is {engine}, which has "
                        "none: use served, or the vllm engine")
    if runtime.get("enablePrefixCaching") is False:
        problems.append(f"{where} needs spec.runtime.enablePrefixCaching (vLLM reports cached blocks only with "
                        "its prefix cache on): use served, or turn prefix caching on")
    args = runtime.get("engineArgs")
    if isinstance(args, Mapping) and "kv_events_config" in args:
        problems.append(f"{where} sets vLLM's kv_events_config (vLLM publishes to one endpoint): remove "
                        "kv_events_config from spec.runtime.engineArgs, or use served")
    return problems


# spec.runtime's typed engine fields -> the vLLM argument each sets (runtime/node/incluster.py maps them).
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


# --------------------------------------------------------------------------- API-key Secrets
# Issue 28, item 3: whoever may write a TenantQuota names the Secret the operator reads with its own
# rights, so the Secret must agree to be read. The runtime namespace is the installer's (only admins
# put Secrets there); anywhere else the Secret opts in with this label, naming the tenant whose keys
# it holds (as cert-manager and external-secrets let a Secret opt in to being read or copied).
KEY_SECRET_LABEL = "zerolayer.io/tenant-keys"
# Never read for a TenantQuota, label or not: the cluster's own credentials live here.
SYSTEM_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")


def key_secret_namespace_problem(namespace: str, name: str, *, fleet_secret: str,
                                 runtime_namespace: str) -> tuple[str, str] | None:
    """(reason, message) of why the API-key Secret ``namespace/name`` may not be read at all, else
    None; decided before any read. System namespaces are refused, and so is the fleet's own
    key-hash Secret."""
    if namespace in SYSTEM_NAMESPACES:
        return ("SecretNamespaceNotAllowed",
                f"apiKeySecretRef.namespace {namespace!r} is a system namespace: the operator never reads "
                "API keys from " + ", ".join(SYSTEM_NAMESPACES))
    if namespace == runtime_namespace and name == fleet_secret:
        return ("SecretNotAllowed",
                f"apiKeySecretRef names {namespace}/{name}, the fleet's Secret of key hashes, not a tenant's keys")
    return None


def key_secret_opt_in_problem(namespace: str, name: str, labels: Mapping[str, str] | None, *, tenant: str,
                              runtime_namespace: str) -> str | None:
    """Why the keys of the API-key Secret ``namespace/name`` (whose labels are ``labels``) may not be
    used for ``tenant``, else None: outside the runtime namespace the Secret must carry
    ``zerolayer.io/tenant-keys: <tenant>``."""
    if namespace == runtime_namespace:
        return None
    value = (labels or {}).get(KEY_SECRET_LABEL)
    if value == tenant:
        return None
    found = f"it is labelled for tenant {value!r}" if value else "it has no such label"
    return (f"API-key Secret {namespace}/{name} is outside the runtime namespace and does not opt in: it needs "
            f"the label {KEY_SECRET_LABEL}={tenant} ({found})")
