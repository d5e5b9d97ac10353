"""Issue 2: the Helm chart lints, installs (operator pod Running), upgrades and uninstalls cleanly."""

from __future__ import annotations

import json
import pathlib

import pytest

pytestmark = pytest.mark.e2e

CHART = str(pathlib.Path(__file__).resolve().parents[2] / "helm" / "zerolayer")
NS = "zerolayer-helm-e2e"
RUNTIME_NS = f"{NS}-runtime"  # the chart's default runtime namespace: <release namespace>-runtime
RELEASE = "zl-e2e"


def test_helm_lint_is_clean(cluster):
    out = cluster.helm("lint", CHART, "--strict")
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@pytest.mark.parametrize("bad", ["operator.replicas=-1", "operator.logLevel=loud", "runtime.port=80",
                                 "operator.image.pullPolicy=Sometimes", "unknownKey=1"])
def test_values_schema_rejects_bad_values(cluster, bad):
    out = cluster.helm("template", "x", CHART, "--kube-version", "1.35.0", "--set", bad, check=False)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr


def _release_objects(cluster) -> list[str]:
    found = []
    for kind in ("deployment", "serviceaccount", "service", "networkpolicy"):
        items = cluster.kubectl_json("get", kind, "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        found += [f"{kind}/{i['metadata']['name']}" for i in items]
    for kind in ("role", "rolebinding"):
        items = cluster.kubectl_json("get", kind, "-n", RUNTIME_NS, "-l",
                                     f"app.kubernetes.io/instance={RELEASE}")["items"]
        found += [f"{kind}/{RUNTIME_NS}/{i['metadata']['name']}" for i in items]
    for kind in ("clusterrole", "clusterrolebinding"):
        items = cluster.kubectl_json("get", kind, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        found += [f"{kind}/{i['metadata']['name']}" for i in items]
    return found


def _phase(cluster, ns: str) -> str:
    out = cluster.kubectl("get", "namespace", ns, "-o", "jsonpath={.status.phase}", check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


def test_install_upgrade_uninstall(cluster):
    cluster.helm("uninstall", RELEASE, "-n", NS, check=False)
    # A namespace left terminating by an earlier run would refuse the chart's objects.
    for ns in (NS, RUNTIME_NS):
        cluster.wait_for(lambda: _phase(cluster, ns) != "Terminating", timeout=120,
                         what=f"namespace {ns} not terminating")
    try:
        cluster.helm("install", RELEASE, CHART, "-n", NS, "--create-namespace", "--wait", "--timeout", "120s")

        def operator_running():
            pods = cluster.kubectl_json("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component=operator")
            return [p for p in pods["items"] if p["status"].get("phase") == "Running"]
        pods = cluster.wait_for(operator_running, timeout=90, what="operator pod Running")
        spec = pods[0]["spec"]
        container = spec["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert spec["serviceAccountName"] == f"{RELEASE}-zerolayer"
        installed = _release_objects(cluster)
        assert "clusterrole/zl-e2e-zerolayer-operator" in installed
        assert any(o.startswith("deployment/") for o in installed)
        # The runtimes live in their own namespace, created by the chart; the operator's rights on
        # runtime workloads are granted there only.
        assert cluster.kubectl_json("get", "namespace", RUNTIME_NS)["metadata"]["annotations"][
            "helm.sh/resource-policy"] == "keep"
        assert any(o.startswith(f"role/{RUNTIME_NS}/") for o in installed)

        # The operator's ServiceAccount may do what it needs and not more.
        sa = f"system:serviceaccount:{NS}:{RELEASE}-zerolayer"
        can = lambda *a: cluster.kubectl("auth", "can-i", *a, f"--as={sa}", check=False).stdout.strip()
        assert can("patch", "inferencenodes.zerolayer.io/status") == "yes"
        assert can("patch", "nodes") == "yes"
        assert can("create", "daemonsets.apps", "-n", RUNTIME_NS) == "yes"
        assert can("create", "daemonsets.apps", "-n", NS) == "no"
        assert can("create", "daemonsets.apps", "-n", "default") == "no"
        assert can("delete", "nodes") == "no"
        assert can("create", "secrets", "-n", NS) == "no"
        assert can("get", "secrets", "-n", "default") == "yes"  # tenants' API-key Secrets, read to hash
        assert can("list", "secrets", "-n", "default") == "no"
        assert can("delete", "customresourcedefinitions") == "no"

        cluster.helm("upgrade", RELEASE, CHART, "-n", NS, "--set", "operator.logLevel=debug", "--wait",
                     "--timeout", "120s")
        dep = cluster.kubectl_json("get", "deployment", f"{RELEASE}-zerolayer-operator", "-n", NS)
        assert "--log-level=debug" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        history = json.loads(cluster.helm("history", RELEASE, "-n", NS, "-o", "json").stdout)
        assert [h["revision"] for h in history] == [1, 2]
    finally:
        cluster.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "120s", check=False)
    assert _release_objects(cluster) == []
    # CRDs stay on uninstall (Helm's policy: deleting them would delete every InferenceNode/TenantQuota).
    assert cluster.kubectl("get", "crd", "inferencenodes.zerolayer.io", check=False).returncode == 0
    # The runtime namespace is kept on uninstall (it holds the runtimes the operator created).
    assert cluster.kubectl("get", "namespace", RUNTIME_NS, check=False).returncode == 0
    cluster.kubectl("delete", "namespace", NS, RUNTIME_NS, "--wait=false", check=False)


def test_chart_rbac_is_exactly_what_the_operator_uses(cluster):
    """One source of truth: the chart's operator rules equal operator/rbac.py."""
    import yaml

    from zerolayer.operator import rbac

    docs = [d for d in yaml.safe_load_all(cluster.helm("template", "x", CHART, "-n", "ns", "--kube-version", "1.35.0").stdout) if d]
    by_kind = {d["kind"]: d for d in docs if d["kind"] in ("ClusterRole", "Role")}

    def norm(rules):
        return sorted((tuple(r.get("apiGroups", [])), tuple(r["resources"]), tuple(r["verbs"])) for r in rules)

    assert norm(by_kind["ClusterRole"]["rules"]) == norm(rbac.CLUSTER_RULES)
    assert norm(by_kind["Role"]["rules"]) == norm(rbac.RUNTIME_NAMESPACE_RULES)
