"""Install or upgrade the zerolayer CustomResourceDefinitions: what the chart's pre-upgrade hook
runs (``zerolayer operator --apply-crds DIR``), because Helm installs a chart's ``crds/`` on the
first install only and never upgrades them.

Each CRD is server-side applied (forced: the chart's copy of the schema is the truth, whoever
wrote it before, ``helm`` included), then waited for until the API server reports it
``Established``. An update of an established CRD takes effect with the write itself, so the
operator that starts after the hook sees the new schema.
Only CRDs of the ``zerolayer.io`` group are accepted: the hook's RBAC names exactly those.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
from typing import Any

import yaml

from zerolayer.operator.errors import ConfigError
from zerolayer.operator.kube import Kube
from zerolayer.operator.manifests import GROUP

log = logging.getLogger(__name__)

CRD = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")


def load_crds(directory: pathlib.Path) -> list[dict]:
    """Every CRD document in ``directory``'s ``*.yaml`` files (sorted by file name); refuses
    anything that is not a CRD of the zerolayer.io group."""
    docs = []
    for path in sorted(pathlib.Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if (doc.get("apiVersion"), doc.get("kind")) != CRD or (doc.get("spec") or {}).get("group") != GROUP:
                raise ConfigError(f"{path.name}: not a CustomResourceDefinition of group {GROUP}")
            docs.append(doc)
    if not docs:
        raise ConfigError(f"no CustomResourceDefinition in {directory}/*.yaml")
    return docs


def established(crd: dict[str, Any]) -> bool:
    """Whether the API server serves the CRD (its names accepted, the kind established)."""
    conds = {c.get("type"): c.get("status") for c in (crd.get("status") or {}).get("conditions") or ()}
    return conds.get("Established") == "True" and conds.get("NamesAccepted") == "True"


async def apply_crds(kube: Kube, docs: list[dict], *, timeout: float = 60.0) -> list[str]:
    """Apply each CRD and wait for all to be Established; returns their names."""
    applied = []
    for doc in docs:
        obj = await kube.apply(doc, force=True)
        applied.append(obj["metadata"]["name"])
        log.info("applied CustomResourceDefinition %s (generation %s)", applied[-1],
                 obj["metadata"].get("generation"))
    deadline = time.monotonic() + timeout
    for name in applied:
        while not established(await kube.get(*CRD, name) or {}):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CustomResourceDefinition {name} not Established after {timeout:.0f} s")
            await asyncio.sleep(0.5)
    return applied
