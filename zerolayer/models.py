"""Where a model's weights live: the layout the operator mounts and the runtime reads.

Shared by both sides (the operator never imports the runtime, nor the runtime the operator),
so one pure module states the contract:

- Every model whose ``source`` is ``hostPath``, ``pvc`` or ``huggingFace`` is mounted
  read-only at :func:`container_path` = ``/models/<dir>``, where ``<dir>`` is the model's name
  made safe for a path (:func:`model_dir`). A ``path`` source names a directory already
  inside the container image and is used as it is.
- ``huggingFace`` sources are downloaded by an init container into the node-local cache
  :data:`CACHE_HOST_DIR` (a hostPath shared by every runtime pod on the node, kept across
  restarts); one complete snapshot per repository and revision lives at
  ``<cache>/<cache_entry(repo, revision)>``. The server mounts exactly that entry.

LoRA adapters load and unload in the running engine (vLLM's dynamic LoRA) when the pod already
sees their weights, so adding one needs no new volume and rolls no pod (:func:`live_adapter`): a
``path`` source, or a ``hostPath`` under :data:`ADAPTERS_HOST_DIR`, which every vLLM runtime pod
mounts read-only at the same path. Other adapter sources get a volume of their own, so adding one
changes the pod.

A ``source`` written as a bare string (the form before typed sources) means ``{path: ...}``:
objects stored under the older CRD keep working (docs/runtime.md, "Model sources").
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping

MODELS_ROOT = "/models"
CACHE_HOST_DIR = "/var/lib/zerolayer/models"  # on the node; also where the fetcher sees it
ADAPTERS_HOST_DIR = "/var/lib/zerolayer/adapters"  # on the node and, read-only, in every vLLM runtime pod
SOURCE_KINDS = ("path", "hostPath", "pvc", "huggingFace")
DEFAULT_REVISION = "main"
DEFAULT_TOKEN_KEY = "token"

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ModelSourceError(ValueError):
    """A model source that names no kind, or more than one."""


def safe_component(value: str) -> str:
    """``value`` as one path component: kept when already safe (letters, digits, ``._-``, at
    most 63 characters), else cleaned and suffixed with a hash of the original, so two
    different values never share a directory."""
    if _SAFE.match(value) and ".." not in value:
        return value
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", value).replace("..", "-").strip("-.")[:54] or "x"
    return f"{cleaned}-{hashlib.sha256(value.encode()).hexdigest()[:8]}"


def model_dir(name: str) -> str:
    """The directory name of model ``name`` under :data:`MODELS_ROOT`."""
    return safe_component(name)


def normalise_source(source: Any) -> dict[str, Any]:
    """The typed source; a bare string is the legacy shorthand for ``{"path": source}``."""
    if isinstance(source, str):
        return {"path": source}
    if isinstance(source, Mapping):
        return dict(source)
    raise ModelSourceError(f"model source must be an object (or a path string), got {type(source).__name__}")


def source_kind(source: Any) -> str:
    """Which of :data:`SOURCE_KINDS` ``source`` sets; exactly one must be set."""
    typed = normalise_source(source)
    kinds = [k for k in SOURCE_KINDS if typed.get(k) not in (None, "", {})]
    if len(kinds) != 1:
        raise ModelSourceError(f"set exactly one of {', '.join(SOURCE_KINDS)} in a model source, got "
                               f"{', '.join(kinds) or 'none'}")
    return kinds[0]


def under_adapters_dir(source: Any) -> bool:
    """Whether ``source`` is a ``hostPath`` inside :data:`ADAPTERS_HOST_DIR` (no ``..``, not the
    directory itself): the pod reads it there without a volume of its own."""
    typed = normalise_source(source)
    path = str((typed.get("hostPath") or {}).get("path") or "")
    return path.startswith(ADAPTERS_HOST_DIR + "/") and ".." not in path.split("/") and \
        path.rstrip("/") != ADAPTERS_HOST_DIR


def live_adapter(adapter: Mapping[str, Any]) -> bool:
    """Whether a LoRA adapter (a ``models[].loras[]`` entry) is read where the pod already looks: a
    ``path`` source or a hostPath under :data:`ADAPTERS_HOST_DIR`. Adding or removing such an
    adapter changes no pod; the runtime loads it into the running engine."""
    source = normalise_source(adapter.get("source"))
    return source_kind(source) == "path" or under_adapters_dir(source)


def container_path(model: Mapping[str, Any]) -> str:
    """Where the server container finds the weights of ``model`` (an InferenceNode ``models[]`` entry)."""
    source = normalise_source(model.get("source"))
    if source_kind(source) == "path":
        return str(source["path"])
    if under_adapters_dir(source):
        return str(source["hostPath"]["path"])
    return f"{MODELS_ROOT}/{model_dir(str(model['name']))}"


def cache_entry(repo: str, revision: str | None) -> str:
    """Relative path of one repository revision's snapshot inside the node cache:
    ``<org>--<name>/<revision>`` (the hub's own ``--`` separator), each part made safe."""
    return f"{safe_component(repo.replace('/', '--'))}/{safe_component(revision or DEFAULT_REVISION)}"


def weight_entries(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Everything with weights to mount for an InferenceNode spec: its models, then every model's
    LoRA adapters (``models[].loras[]``, each ``{name, source}`` like a model). Adapters come after
    all models so a model's index (its volume and download container names) does not move when
    adapters are added. Names are unique across the list (checked at admission), so every entry
    has its own :func:`container_path`."""
    models = [m for m in spec.get("models") or () if isinstance(m, Mapping)]
    return [*models, *(a for m in models for a in m.get("loras") or () if isinstance(a, Mapping))]


class GpuPlanError(ValueError):
    """The models' ``gpus`` do not fit the pod's GPUs."""


def gpu_plan(models: list[Mapping[str, Any]], gpus: int) -> list[tuple[tuple[int, ...], int]]:
    """Which GPUs each model's engine sees, as ``(device indices, engines sharing them)`` per model.

    A model that sets ``gpus: n`` gets the next ``n`` of the pod's ``gpus`` devices to itself, in
    list order. The models that set none share the devices left over (each engine then takes an
    equal part of the GPU memory fraction). Without GPUs (``gpus`` 0) every engine runs on the CPU:
    ``((), 1)`` each.
    """
    if gpus <= 0:
        return [((), 1) for _ in models]
    plan: list[tuple[tuple[int, ...], int] | None] = []
    taken = 0
    for model in models:
        asked = model.get("gpus")
        if asked:
            plan.append((tuple(range(taken, taken + int(asked))), 1))
            taken += int(asked)
        else:
            plan.append(None)
    if taken > gpus:
        raise GpuPlanError(f"the models' gpus add up to {taken}, but the pod gets {gpus} (spec.runtime.gpus)")
    sharers = [str(m.get("name")) for m, p in zip(models, plan) if p is None]
    rest = tuple(range(taken, gpus))
    if sharers and not rest:
        raise GpuPlanError(f"no GPU is left for {', '.join(sharers)}: the other models take all {gpus} "
                           "(give these models gpus, or the pod more)")
    return [p if p is not None else (rest, len(sharers)) for p in plan]
