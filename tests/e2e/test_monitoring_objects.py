"""Issue 30: the chart's monitoring objects are accepted by a real API server carrying the
prometheus-operator CRDs (vendored, tests/e2e/crds/prometheus-operator/): the operator's
ServiceMonitor, the runtimes' PodMonitor, the PrometheusRule and the Grafana dashboard ConfigMap.
That their queries return data is tests/integration/runtime/test_observability_vllm.py."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from tests.helm_render import render

pytestmark = pytest.mark.e2e

CRDS = pathlib.Path(__file__).parent / "crds" / "prometheus-operator"
NS = "zerolayer-monitoring-e2e"
RELEASE = "zlmon"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _phase(cluster) -> str:
    out = cluster.kubectl("get", "namespace", NS, "-o", "jsonpath={.status.phase}", check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


@pytest.fixture(scope="module")
def monitoring_crds(cluster):
    for crd in sorted(CRDS.glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    for crd in ("podmonitors", "servicemonitors", "prometheusrules"):
        cluster.wait_established(f"{crd}.monitoring.coreos.com")
    # A namespace left terminating by an earlier run would refuse the objects.
    cluster.wait_for(lambda: _phase(cluster) != "Terminating", timeout=120, what=f"namespace {NS} not terminating")
    cluster.kubectl("create", "namespace", NS, check=False)
    yield
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _monitoring_objects() -> list[dict]:
    objects = render("metrics.serviceMonitor=true", "metrics.podMonitor=true", "metrics.prometheusRule=true",
                     "metrics.grafanaDashboard=true", "metrics.labels.release=kube-prometheus-stack",
                     release=RELEASE, namespace=NS)
    return [o for o in objects if o["kind"] in MONITORING_KINDS
            or (o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1")]


def test_the_chart_monitoring_objects_apply_to_the_real_api_server(cluster, monitoring_crds):
    objects = _monitoring_objects()
    assert {o["kind"] for o in objects} == MONITORING_KINDS | {"ConfigMap"}
    # --validate=strict: the API server refuses a field its CRD schema does not declare
    cluster.kubectl("apply", "--server-side", "--validate=strict", "-f", "-",
                    input="\n---\n".join(yaml.safe_dump(o) for o in objects))
    stored = {kind: cluster.kubectl_json("get", kind.lower(), "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")
              for kind in MONITORING_KINDS}
    pod_monitor = stored["PodMonitor"]["items"][0]
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "audit-metrics"]
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = stored["PrometheusRule"]["items"][0]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "ZerolayerNodeNotGossiping" in alerts and "ZerolayerBillingMismatch" in alerts
    assert stored["ServiceMonitor"]["items"][0]["spec"]["endpoints"] == [{"port": "metrics"}]
    dashboard = cluster.kubectl_json("get", "configmap", f"{RELEASE}-zerolayer-dashboard", "-n", NS)
    assert json.loads(dashboard["data"]["zerolayer.json"])["uid"] == "zerolayer-fleet"


def test_the_api_server_refuses_a_rule_the_crd_schema_refuses(cluster, monitoring_crds):
    """The CRDs validate for real: a PrometheusRule whose alert has no expr is refused (the test can fail)."""
    (rule,) = [o for o in _monitoring_objects() if o["kind"] == "PrometheusRule"]
    del rule["spec"]["groups"][1]["rules"][0]["expr"]
    rule["metadata"]["name"] = "broken"
    out = cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(rule), check=False)
    assert out.returncode != 0 and "expr" in out.stderr
