"""``InferenceNode.spec.audit.retentionDays`` reaches the auditor's store: the operator passes it as
``--retention``, the auditor turns it into its detail retention, and pruning drops older detail."""

from __future__ import annotations

import argparse

import pytest

from zerolayer.bpf import cli as audit_cli
from zerolayer.bpf.auditor import AuditorSettings
from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")


def auditor_args(audit: dict | None) -> list[str]:
    spec = {"nodeName": "n0", "models": [{"name": "tiny", "source": "/m"}]}
    if audit is not None:
        spec["audit"] = audit
    ds = m.build_daemonset({"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
                            "metadata": {"name": "n0", "uid": "u", "generation": 1}, "spec": spec}, CONFIG, node_gpus=1)
    [auditor] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "auditor"]
    return auditor["args"]


def parsed(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    audit_cli.register(parser.add_subparsers())
    return parser.parse_args(args)


@pytest.mark.parametrize("audit,days", [(None, 30), ({}, 30), ({"retentionDays": 3}, 3), ({"retentionDays": 400}, 400)])
def test_retention_days_become_the_auditors_detail_retention(audit, days):
    args = auditor_args(audit)
    assert f"--retention={days}d" in args
    namespace = parsed(args)
    assert namespace.retention == days * 86400
    assert AuditorSettings(detail_retention_s=namespace.retention).detail_retention_s == days * 86400
