"""Issue 2: the Helm chart lints, installs (operator pods Running), upgrades and uninstalls cleanly.
Issue 16: the chart's CRD-upgrade hook and its narrowed RBAC (leader Lease and key-hash Secret by name)."""

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
        pods = cluster.wait_for(lambda: len(operator_running()) == 2 and operator_running(), timeout=90,
                                what="two operator pods Running (one leads, one stands by)")
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
        # the key-hash Secret is patched by name only; the Lease is read and renewed by name only
        assert can("patch", "secrets/zl-tenant-keys", "-n", RUNTIME_NS) == "yes"
        assert can("patch", "secrets/someone-elses", "-n", RUNTIME_NS) == "no"
        lease = f"{RELEASE}-zerolayer-operator"
        assert can("update", f"leases.coordination.k8s.io/{lease}", "-n", NS) == "yes"
        assert can("update", "leases.coordination.k8s.io/other", "-n", NS) == "no"
        assert can("update", f"leases.coordination.k8s.io/{lease}", "-n", RUNTIME_NS) == "no"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["ZEROLAYER_LEASE_NAME"] == lease and env["ZEROLAYER_LEADER_ELECTION"] == "true"
        assert float(env["ZEROLAYER_RESYNC_SECONDS"]) >= 3600
        assert can("delete", "customresourcedefinitions") == "no"

        # the pre-upgrade hook (CRD apply Job) runs first; kwok completes Job pods without running
        # them, so what the Job does is tested by test_crd_upgrade_hook_step below
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


def _rendered(cluster, *args: str) -> list[dict]:
    import yaml

    out = cluster.helm("template", RELEASE, CHART, "-n", NS, "--kube-version", "1.35.0", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_rbac_is_exactly_what_the_operator_uses(cluster):
    """One source of truth: the chart's operator rules equal operator/rbac.py."""
    from zerolayer.operator import rbac

    by_name = {(d["kind"], d["metadata"]["name"]): d for d in _rendered(cluster)
               if d["kind"] in ("ClusterRole", "Role")}
    full = f"{RELEASE}-zerolayer-operator"

    def norm(rules):
        return sorted((tuple(r.get("apiGroups", [])), tuple(r["resources"]), tuple(r.get("resourceNames", [])),
                       tuple(r["verbs"])) for r in rules)

    assert norm(by_name[("ClusterRole", full)]["rules"]) == norm(rbac.CLUSTER_RULES)
    assert norm(by_name[("Role", full)]["rules"]) == norm(rbac.RUNTIME_NAMESPACE_RULES)
    assert norm(by_name[("Role", f"{full}-leader")]["rules"]) == norm(rbac.operator_namespace_rules(full))


def test_crd_upgrade_hook_step(cluster, tmp_path):
    """What the pre-upgrade hook Job does, run here as a process under the hook's own rendered
    ServiceAccount rules: a cluster holding an older TenantQuota schema (one spec field missing)
    gets the chart's schema back, from the files the hook's ConfigMap carries."""
    import pathlib
    import subprocess
    import sys

    import yaml

    docs = _rendered(cluster)
    hooks = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "pre-upgrade"]
    kinds = {d["kind"] for d in hooks}
    assert kinds == {"ConfigMap", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}, kinds
    job = next(d for d in hooks if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["operator", "--apply-crds=/crds"]
    [configmap] = [d for d in hooks if d["kind"] == "ConfigMap"]
    chart_crds = pathlib.Path(CHART) / "crds"
    assert configmap["data"] == {p.name: p.read_text() for p in sorted(chart_crds.glob("*.yaml"))}
    assert [d for d in _rendered(cluster, "--set", "crds.upgrade=false")
            if (d["metadata"].get("annotations") or {}).get("helm.sh/hook")] == []

    crd_name = "tenantquotas.zerolayer.io"
    current = yaml.safe_load((chart_crds / f"{crd_name}.yaml").read_text())
    spec_props = current["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    dropped = sorted(spec_props)[-1]
    old = yaml.safe_load((chart_crds / f"{crd_name}.yaml").read_text())
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][dropped]

    def served_fields():
        crd = cluster.kubectl_json("get", "crd", crd_name)
        return set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])

    ns = f"zl-e2e-crdhook-{tmp_path.name[-6:]}".lower().replace("_", "-")
    sa = "crd-upgrade"
    role = next(d for d in hooks if d["kind"] == "ClusterRole")
    role_name = f"{role['metadata']['name']}-{ns}"
    cluster.kubectl("create", "namespace", ns)
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm", "-f", "-",
                        input=json.dumps(old))
        assert dropped not in served_fields()  # the "old release" schema

        cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "List", "items": [
                {**role, "metadata": {"name": role_name}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": role_name},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
                 "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}]}))
        token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=10m").stdout.strip()
        config = yaml.safe_load(pathlib.Path(cluster.kubeconfig).read_text())
        config["users"] = [{"name": sa, "user": {"token": token}}]
        for ctx in config["contexts"]:
            ctx["context"]["user"] = sa
        kubeconfig = tmp_path / "hook.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        mounted = tmp_path / "crds"  # what the Job's ConfigMap volume shows at /crds
        mounted.mkdir()
        for name, text in configmap["data"].items():
            (mounted / name).write_text(text)

        proc = subprocess.run([sys.executable, "-m", "zerolayer.cli", "operator", f"--apply-crds={mounted}",
                               "--kubeconfig", str(kubeconfig)], capture_output=True, text=True, timeout=120,
                              env=cluster.env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        applied = proc.stdout.split("applied and established: ", 1)[1].split("\n", 1)[0].split(", ")
        assert sorted(applied) == ["inferencefleets.zerolayer.io", "inferencenodes.zerolayer.io",
                                   "tenantquotas.zerolayer.io"], proc.stdout
        assert served_fields() == set(spec_props)  # the chart's schema again, the dropped field included
        crd = cluster.kubectl_json("get", "crd", crd_name, "--show-managed-fields")
        managers = {f["manager"] for f in crd["metadata"]["managedFields"]}
        assert "zerolayer-operator" in managers
    finally:
        # whatever happened, leave the session's CRDs as the repository has them
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(chart_crds))
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", role_name, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
