"""Shared fixtures for the regression tier's manifest tests: one InferenceNode and one TenantQuota."""

from __future__ import annotations

import inspect

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="zerolayer/zerolayer:1",
                        metrics_scraper_namespaces=("monitoring",))


def inode(name: str = "gpu-0", uid: str = "u-1", **spec) -> dict:  # type: ignore[no-untyped-def]
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": name, "uid": uid, "generation": 1},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "tiny", "source": {"path": "/models/tiny"}}],
                     **spec}}


def daemonset(body: dict, node_gpus: int = 1) -> dict:
    """build_daemonset, told the Node's GPU count where it takes it."""
    if "node_gpus" in inspect.signature(m.build_daemonset).parameters:
        return m.build_daemonset(body, CONFIG, node_gpus=node_gpus)
    return m.build_daemonset(body, CONFIG)


def containers(ds: dict) -> dict:
    return {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
