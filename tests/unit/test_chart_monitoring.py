"""Issue 30: the chart's monitoring objects render from the values (real Helm; the proof that their
queries return data against a real Prometheus is tests/integration/runtime/test_observability_vllm.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.helm_render import helm_binary, monitoring_objects, render

needs_helm = pytest.mark.skipif(helm_binary() is None, reason="no Helm built yet: run scripts/setup.sh")

ALERTS = {"ZerolayerRuntimeDown", "ZerolayerNodeNotGossiping", "ZerolayerSheddingSustained",
          "ZerolayerTenantQuotaExhausted", "ZerolayerAuditorLagging", "ZerolayerAuditorJournalMode",
          "ZerolayerBillingMismatch", "ZerolayerOperatorNoLeader"}
# An alert is "<series> <op> <number>": the integration test evaluates <series> on its own.
ALERT_SHAPE = re.compile(r"^(?P<series>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<number>[0-9.]+)$")


@needs_helm
def test_monitoring_is_off_by_default():
    kinds = {(o["kind"], (o["metadata"].get("labels") or {}).get("grafana_dashboard")) for o in render()}
    assert not {k for k, _ in kinds} & {"PodMonitor", "PrometheusRule", "ServiceMonitor"}
    assert ("ConfigMap", "1") not in kinds


@needs_helm
def test_podmonitor_scrapes_the_runtime_pods_server_and_auditor():
    pm = monitoring_objects("metrics.labels.release=kps")["PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["zl-system-runtime"]}
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "zerolayer-runtime"
    # the port names the operator gives the server and auditor containers (operator/manifests.py)
    from zerolayer.operator.manifests import AUDIT_METRICS_PORT_NAME, METRICS_PORT_NAME

    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [METRICS_PORT_NAME, AUDIT_METRICS_PORT_NAME]


@needs_helm
def test_rules_cover_the_fleet_alerts_and_follow_the_values():
    rule = monitoring_objects("metrics.alerts.nodeNotGossiping.missedHeartbeats=5",
                              "metrics.alerts.auditorLagging.for=7m")["PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == ALERTS
    for name, alert in alerts.items():
        assert ALERT_SHAPE.match(alert["expr"]), f"{name}: {alert['expr']!r} is not '<series> <op> <number>'"
    assert alerts["ZerolayerNodeNotGossiping"]["expr"].endswith("> 5")
    assert alerts["ZerolayerAuditorLagging"]["for"] == "7m"
    assert alerts["ZerolayerRuntimeDown"]["expr"] == 'up{job="zl-system/zl-zerolayer-runtime"} == 0'


@needs_helm
def test_rules_pass_promtool(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("no promtool: scripts/setup.sh installs Debian's prometheus as root")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(monitoring_objects()["PrometheusRule"]["spec"]))
    out = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_helm
def test_dashboard_configmap_is_for_the_grafana_sidecar():
    cm = monitoring_objects("metrics.dashboardNamespace=grafana")["Dashboard"]
    assert cm["metadata"]["namespace"] == "grafana"
    dashboard = json.loads(cm["data"]["zerolayer.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Tokens per second by tenant", "Refusals by reason", "Time to first token",
                   "Time per output token", "KV cache use", "Scheduler queue", "GPU map: memory used", "Audit lag"):
        assert wanted in titles
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])


@needs_helm
@pytest.mark.parametrize("bad", ["metrics.interval=soon", "metrics.alerts.auditorLagging.seconds=-1",
                                 "metrics.alerts.nodeNotGossiping.when=1m", "runtime.port=9465",
                                 "runtime.metricsPort=9465"])
def test_schema_refuses_bad_monitoring_values(bad):
    with pytest.raises(subprocess.CalledProcessError) as info:
        render(bad)
    assert "values don't meet the specifications of the schema" in info.value.stderr


def test_an_inference_node_cannot_serve_on_the_auditors_metrics_port():
    from zerolayer.operator.validation import inference_node_problems

    spec = {"nodeName": "n", "models": [{"name": "m", "source": "hf://org/m"}], "runtime": {"port": 9465}}
    assert any("auditor's metrics port" in p for p in inference_node_problems(spec))
    assert not any("auditor's metrics port" in p for p in inference_node_problems({**spec, "audit": {"enabled": False}}))
