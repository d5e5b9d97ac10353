"""Review finding 24: ClickHouse credentials sat in the InferenceNode spec (``clickhouseUrl``,
readable by every runtime) and in the auditor's argv (``kubectl describe pod``). They now come from a
Secret (``audit.clickhouseCredentialsSecretRef``) through ``secretKeyRef`` env; the CRD refuses a URL
with credentials in it."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from tests.regression.manifest_fixtures import containers, daemonset, inode

pytestmark = [pytest.mark.regression]

CRD = pathlib.Path(__file__).resolve().parents[2] / "crds" / "inferencenodes.zerolayer.io.yaml"


def audit_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["audit"]


def test_the_crd_refuses_credentials_in_the_url():
    pattern = re.compile(audit_schema()["properties"]["clickhouseUrl"]["pattern"])
    assert pattern.match("http://ch.audit:8123/zerolayer")
    assert not pattern.match("http://admin:hunter2@ch.audit:8123/zerolayer")


def test_credentials_reach_the_auditor_from_a_secret_not_args():
    ds = daemonset(inode(audit={"store": "clickhouse", "clickhouseUrl": "http://ch.audit:8123/zl",
                                "clickhouseCredentialsSecretRef": {"name": "ch-creds"}}))
    auditor = containers(ds)["auditor"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in auditor["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {r["name"] for r in refs.values()} == {"ch-creds"} and len(refs) == 2
    assert "ch-creds" not in " ".join(auditor["args"])
    # argv holds only references the kubelet expands inside the container, never a value
    clickhouse = [a for a in auditor["args"] if a.startswith("--clickhouse=")]
    assert clickhouse and all(f"$({name})" in clickhouse[0] for name in refs)
