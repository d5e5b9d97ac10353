"""Checks the CRD schema cannot express (cross-field rules), plus the basics again.

The API server already enforces the schemas in crds/; repeating the required basics here
keeps the operator from acting on an object admitted under an older CRD. Each function
returns a list of problems in plain words (empty means valid).
"""

from __future__ import annotations

from typing import Any, Mapping

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
