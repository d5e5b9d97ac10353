"""What the operator renders into the runtime's config file.

The in-cluster runtime builds its config from its InferenceNode, laid over a standalone config file
(``zerolayer runtime --in-cluster --config FILE``; ``runtime/node/incluster.py``
``config_from_inferencenode``). Most settings come from the InferenceNode, which the runtime reads
itself. ``server.api_processes`` cannot: when ``spec.runtime.apiProcesses`` is unset its number follows
the server container's CPU request, and that request is the operator's to know (the chart's
``runtime.resources`` merged with ``spec.runtime.resources``). So the operator renders that file
(:func:`runtime_config`), with ``server.api_processes`` always explicit, and the runtime pod reads it
from its own pod annotation (``manifests.RUNTIME_CONFIG_ANNOTATION``, a downward-API file).
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Mapping

API_PROCESSES_FIELD = "spec.runtime.apiProcesses"
API_PROCESSES_MIN, API_PROCESSES_MAX = 1, 64  # the CRD's minimum and maximum
CORES_PER_API_PROCESS = 4
DEFAULT_API_PROCESSES_CAP = 8

# A Kubernetes quantity (resource.Quantity's grammar, the CRD's pattern): a signed decimal number, then
# a binary suffix (Ki..Ei), a decimal one (n, u, m, k, M, G, T, P, E) or a decimal exponent (e3, E-2).
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
                       r"(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([numkMGTPE])|[eE]([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)))?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: Any) -> Fraction:
    """A Kubernetes quantity as an exact number: ``"500m"`` is 1/2, ``"4"`` 4, ``"1.5"`` 3/2, ``"1Ki"``
    1024. Numbers (from a YAML values file) pass as they are. Raises ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return Fraction(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, binary, decimal, exponent = match.groups()
    try:
        result = Fraction(Decimal(number))
        if binary:
            return result * 1024 ** _BINARY[binary]
        if decimal:
            return result * Fraction(10) ** _DECIMAL[decimal]
        if exponent:
            power = Fraction(Decimal(exponent))
            if power.denominator != 1:
                raise ValueError(f"not a quantity: {value!r}")
            return result * Fraction(10) ** int(power)
    except InvalidOperation as exc:
        raise ValueError(f"not a quantity: {value!r}") from exc
    return result


def cpu_request_cores(resources: Mapping[str, Any] | None) -> Fraction | None:
    """The CPU request, in cores, of a container with these ``resources``: ``requests.cpu``, else
    ``limits.cpu`` (Kubernetes gives a container with a limit and no request a request equal to the
    limit); None without either, or when it is not a quantity (the API server refuses that pod anyway)."""
    resources = resources or {}
    for section in ("requests", "limits"):
        value = (resources.get(section) or {}).get("cpu")
        if value is not None and value != "":
            try:
                return parse_quantity(value)
            except ValueError:
                return None
    return None


def default_api_processes(cpu_request: float | Fraction | None) -> int:
    """How many API processes a runtime gets when ``spec.runtime.apiProcesses`` is unset: one per
    :data:`CORES_PER_API_PROCESS` requested cores, rounded down, at least 1 and at most
    :data:`DEFAULT_API_PROCESSES_CAP`; 1 without a CPU request (``cpu_request`` None, or not above 0).

    Why that rule. An API process is one Python interpreter: it carries about one core of HTTP, auth,
    quota and scheduling work, and more processes are what lets the runtime use more cores
    (docs/benchmarks.md, "The plan for a 32-core GPU host"). But the API processes are not all the pod
    runs: the engine core (vLLM's ``EngineCore``, which drives the GPU and must not wait for a core),
    tokenization and detokenization share the same CPU request. Giving the API side one process per four
    requested cores leaves three of every four to them, which on the 32-core host of that plan is the 4-8
    processes it starts with (8 here). Below four cores there is no core to spare for a second interpreter,
    so 1: that is also vLLM's own default (``vllm serve --api-server-count`` is 1), and what the runtime
    was before it could run more. The cap of 8 keeps a large request from multiplying processes whose
    quota claims and shared scheduler state grow with their number; more than 8 is still one explicit
    ``spec.runtime.apiProcesses`` away (up to :data:`API_PROCESSES_MAX`).
    """
    if cpu_request is None or cpu_request <= 0:
        return 1
    return max(API_PROCESSES_MIN, min(DEFAULT_API_PROCESSES_CAP, math.floor(cpu_request / CORES_PER_API_PROCESS)))


def api_processes_problem(spec: Mapping[str, Any]) -> str | None:
    """Why ``spec.runtime.apiProcesses`` is refused, or None: not an integer from 1 to 64. Unset is fine:
    :func:`api_processes` then gives the number. A node serving several models takes any number too: the
    API processes share one engine core per model."""
    runtime = spec.get("runtime") or {}
    if runtime.get("apiProcesses") is None:
        return None
    value = runtime["apiProcesses"]
    if isinstance(value, bool) or not isinstance(value, int) or not API_PROCESSES_MIN <= value <= API_PROCESSES_MAX:
        return (f"{API_PROCESSES_FIELD} must be an integer from {API_PROCESSES_MIN} to {API_PROCESSES_MAX}, "
                f"got {value!r}")
    return None


def api_processes(spec: Mapping[str, Any], resources: Mapping[str, Any] | None) -> int:
    """The runtime's ``server.api_processes``: ``spec.runtime.apiProcesses`` when given, else
    :func:`default_api_processes` of the server container's CPU request (``resources``: the container's
    merged requests and limits). A refused value (:func:`api_processes_problem`) never gets here: the operator writes no pod for an
    InferenceNode with problems; should one, the default stands in."""
    runtime = spec.get("runtime") or {}
    if runtime.get("apiProcesses") is not None and api_processes_problem(spec) is None:
        return int(runtime["apiProcesses"])
    return default_api_processes(cpu_request_cores(resources))


def runtime_config(spec: Mapping[str, Any], resources: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config file the runtime lays its InferenceNode (``spec``) over: ``{"server": {"api_processes": N}}``."""
    return {"server": {"api_processes": api_processes(spec, resources)}}


def runtime_config_text(spec: Mapping[str, Any], resources: Mapping[str, Any] | None) -> str:
    """:func:`runtime_config` as the file's text: JSON, which is YAML (the runtime reads the file with
    ``yaml.safe_load``), with sorted keys so equal configs are equal text."""
    return json.dumps(runtime_config(spec, resources), sort_keys=True, separators=(",", ":"))
