"""Issue 2: the API server accepts every example and rejects invalid resources with readable messages."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]


def _k8s_docs(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict) and "apiVersion" in d and "kind" in d]


EXAMPLE_FILES = sorted(p for p in (REPO / "examples").rglob("*.yaml") if _k8s_docs(p))


def test_there_are_examples_of_both_kinds():
    kinds = {d["kind"] for p in EXAMPLE_FILES for d in _k8s_docs(p)}
    assert {"InferenceNode", "TenantQuota"} <= kinds


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_api_server_accepts_example(cluster, path):
    for ns in {d["metadata"].get("namespace") for d in _k8s_docs(path)} - {None}:
        cluster.kubectl("create", "namespace", ns, check=False)
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
    assert out.returncode == 0, out.stderr


def _node(**spec) -> dict:
    base = {"nodeName": "gpu-node-0", "models": [{"name": "m", "source": {"path": "/models/m"}}]}
    base.update(spec)
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "invalid-probe"}, "spec": base}


def _quota(**spec) -> dict:
    base = {"tenant": "acme", "apiKeySecretRef": {"name": "acme-keys"}, "namespaces": ["acme"],
            "tokensPerMinute": 1000, "requestsPerMinute": 10}
    base.update(spec)
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
            "metadata": {"name": "invalid-probe"}, "spec": base}


def _without(doc: dict, key: str) -> dict:
    doc = copy.deepcopy(doc)
    del doc["spec"][key]
    return doc


INVALID = [
    ("threshold above 1", _node(scheduler={"memoryThreshold": 1.5}),
     ["spec.scheduler.memoryThreshold", "less than or equal to 1"]),
    ("threshold zero", _node(scheduler={"memoryThreshold": 0}), ["spec.scheduler.memoryThreshold"]),
    ("resume above shed threshold (hysteresis)", _node(scheduler={"memoryThreshold": 0.9, "resumeThreshold": 0.95}),
     ["resumeThreshold must be below"]),
    ("normal below low threshold", _node(scheduler={"memoryThreshold": 0.9, "normalThreshold": 0.8}),
     ["normalThreshold must be at or above"]),
    ("missing nodeName", _without(_node(), "nodeName"), ["spec.nodeName", "Required value"]),
    ("node name not a DNS name", _node(nodeName="GPU_Node"), ["spec.nodeName", "should match"]),
    ("no models", _node(models=[]), ["spec.models", "at least 1"]),
    ("duplicate model names", _node(models=[{"name": "m", "source": {"path": "/a"}}, {"name": "m", "source": {"path": "/b"}}]),
     ["spec.models[1]", "Duplicate value"]),
    ("model source with two kinds", _node(models=[{"name": "m", "source": {"path": "/a",
                                                                            "hostPath": {"path": "/b"}}}]),
     ["spec.models[0].source", "set exactly one of source.path"]),
    ("model source with no kind", _node(models=[{"name": "m", "source": {}}]), ["set exactly one of source.path"]),
    ("legacy string source", _node(models=[{"name": "m", "source": "/models/m"}]),
     ["spec.models[0].source", "must be of type object"]),
    ("relative hostPath", _node(models=[{"name": "m", "source": {"hostPath": {"path": "models/m"}}}]),
     ["spec.models[0].source.hostPath.path", "should match"]),
    ("pvc subPath escaping the volume", _node(models=[{"name": "m", "source": {"pvc": {"claimName": "w",
                                                                                         "subPath": "a/../.."}}}]),
     ["pvc.subPath must be a relative path without '..'"]),
    ("huggingFace repo with a scheme", _node(models=[{"name": "m", "source": {"huggingFace": {
        "repo": "https://hub/org/name"}}}]), ["spec.models[0].source.huggingFace.repo", "should match"]),
    ("huggingFace token ref without a name", _node(models=[{"name": "m", "source": {"huggingFace": {
        "repo": "org/name", "tokenSecretRef": {"key": "t"}}}}]),
     ["spec.models[0].source.huggingFace.tokenSecretRef.name", "Required value"]),
    ("unknown engine", _node(runtime={"engine": "tgi"}), ["spec.runtime.engine", "Unsupported value"]),
    ("port below 1024", _node(runtime={"port": 80}), ["spec.runtime.port"]),
    ("reset without defrag", _node(defrag={"enabled": False, "allowReset": True}),
     ["allowReset needs defrag.enabled"]),
    ("clickhouse without url", _node(audit={"store": "clickhouse"}), ["clickhouseUrl is required"]),
    ("unknown priority", _quota(allowedPriorities=["urgent"]), ["spec.allowedPriorities[0]", "Unsupported value"]),
    ("negative token rate", _quota(tokensPerMinute=-5), ["spec.tokensPerMinute", "greater than or equal to 1"]),
    ("zero request rate", _quota(requestsPerMinute=0), ["spec.requestsPerMinute"]),
    ("missing Secret reference", _without(_quota(), "apiKeySecretRef"), ["spec.apiKeySecretRef", "Required value"]),
    ("Secret reference without a name", _quota(apiKeySecretRef={"key": "k"}),
     ["spec.apiKeySecretRef.name", "Required value"]),
    ("no client namespaces", _quota(namespaces=[]), ["spec.namespaces", "at least 1"]),
    ("tenant name with capitals", _quota(tenant="Acme"), ["spec.tenant", "should match"]),
    ("price not a decimal", _quota(prices={"inputPer1kTokens": "cheap"}), ["spec.prices.inputPer1kTokens"]),
    ("missing rates", _without(_quota(), "tokensPerMinute"), ["spec.tokensPerMinute", "Required value"]),
]


@pytest.mark.parametrize("doc,needles", [(d, n) for _, d, n in INVALID], ids=[i[0] for i in INVALID])
def test_api_server_rejects_invalid_resource_with_a_readable_message(cluster, doc, needles):
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert out.returncode != 0, f"accepted an invalid {doc['kind']}: {doc['spec']}"
    assert "is invalid" in out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


def test_every_model_source_kind_is_accepted_with_its_defaults(cluster):
    doc = _node(models=[
        {"name": "a", "source": {"path": "/opt/model"}},
        {"name": "b", "source": {"hostPath": {"path": "/srv/models/b"}}},
        {"name": "c", "source": {"pvc": {"claimName": "weights", "subPath": "c/v1"}}},
        {"name": "d", "source": {"huggingFace": {"repo": "org/name", "tokenSecretRef": {"name": "hf"},
                                                 "endpoint": "http://mirror.local:8080"}}},
    ])
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(doc))
    hf = json.loads(out.stdout)["spec"]["models"][3]["source"]["huggingFace"]
    assert hf["revision"] == "main" and hf["tokenSecretRef"]["key"] == "token"


def test_kubectl_explain_documents_the_model_source(cluster):
    # kubectl wraps descriptions at 80 columns: compare with the line breaks folded away.
    out = " ".join(cluster.kubectl("explain", "inferencenode.spec.models.source").stdout.split())
    for needle in ("exactly one of path, hostPath, pvc and huggingFace", "huggingFace", "pvc", "hostPath"):
        assert needle in out, out
    assert "node-local cache" in " ".join(
        cluster.kubectl("explain", "inferencenode.spec.models.source.huggingFace").stdout.split())


def test_immutable_fields_cannot_change(cluster):
    doc = _quota()
    doc["metadata"]["name"] = "immutable-probe"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    try:
        doc["spec"]["tenant"] = "other"
        out = cluster.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
        assert out.returncode != 0 and "spec.tenant is immutable" in out.stderr
    finally:
        cluster.kubectl("delete", "tenantquota", "immutable-probe", "--wait=false", check=False)


def test_defaults_are_filled_in(cluster):
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(_node()))
    spec = json.loads(out.stdout)["spec"]
    assert spec["scheduler"]["memoryThreshold"] == 0.92
    assert spec["scheduler"]["sampleIntervalMs"] == 200
    assert spec["defrag"]["allowReset"] is False and spec["defrag"]["intervalSeconds"] == 300
    q = json.loads(cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                                   input=json.dumps(_quota())).stdout)["spec"]
    assert q["allowedPriorities"] == ["normal", "low"]
    assert q["apiKeySecretRef"]["key"] == "api-keys"


def test_printer_columns_and_short_names(cluster):
    node = _node()
    node["metadata"]["name"] = "columns-probe"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))
    try:
        cluster.kubectl("patch", "inferencenode", "columns-probe", "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"gpusAdmitting": "3/4", "memoryPercent": 41, "phase": "Ready",
                                               "conditions": [{"type": "Ready", "status": "True", "reason": "Probe",
                                                               "message": "", "lastTransitionTime":
                                                               "2026-01-01T00:00:00Z"}]}}))
        out = cluster.kubectl("get", "inode", "columns-probe").stdout
        header, row = out.splitlines()[:2]
        assert header.split() == ["NAME", "NODE", "GPUS", "MEMORY", "PHASE", "READY", "AGE"]
        assert row.split()[:6] == ["columns-probe", "gpu-node-0", "3/4", "41", "Ready", "True"]
        tq_header = cluster.kubectl("get", "tenantquotas").stdout.splitlines()
        assert not tq_header or tq_header[0].split()[:4] in (["NAME", "TENANT", "TOKENS/MIN", "USED"],
                                                              ["No", "resources", "found"])
        cats = cluster.kubectl("get", "zerolayer").stdout
        assert "columns-probe" in cats
    finally:
        cluster.kubectl("delete", "inferencenode", "columns-probe", "--wait=false", check=False)


@pytest.mark.parametrize("field,needle", [
    ("inferencenode.spec", "Desired state of the inference node"),
    ("inferencenode.spec.scheduler.memoryThreshold", "refused"),
    ("inferencenode.status.gpus", "live GPU map"),
    ("tenantquota.spec.apiKeySecretRef", "SHA-256"),
    ("tenantquota.spec.allowedPriorities", "Priorities the tenant may ask for"),
])
def test_kubectl_explain_reads_like_documentation(cluster, field, needle):
    out = " ".join(cluster.kubectl("explain", field).stdout.split())  # explain wraps lines
    assert needle in out


def test_a_tenant_namespace_admin_cannot_write_tenant_quotas(cluster):
    """TenantQuota is cluster-scoped and not aggregated into admin/edit: a namespace admin can't raise it."""
    cluster.kubectl("create", "namespace", "tenant-probe", check=False)
    cluster.kubectl("create", "rolebinding", "probe-admin", "--clusterrole=admin", "--user=tenant-user",
                    "-n", "tenant-probe", check=False)
    try:
        out = cluster.kubectl("auth", "can-i", "patch", "tenantquotas.zerolayer.io", "--as=tenant-user",
                              check=False)
        assert out.stdout.strip() == "no"
        out = cluster.kubectl("auth", "can-i", "create", "tenantquotas.zerolayer.io", "--as=tenant-user",
                              "-n", "tenant-probe", check=False)
        assert out.stdout.strip() == "no"
    finally:
        cluster.kubectl("delete", "namespace", "tenant-probe", "--wait=false", check=False)
