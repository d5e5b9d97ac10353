"""Issue 30: a real Prometheus (Debian's) scrapes a real ``zerolayer operator`` reconciling an
InferenceNode on the local control plane's API server, with the chart's rules loaded as Helm renders
them; every dashboard panel and rule that reads the operator's series (``zerolayer_operator_*``,
tests/dashboard_queries.py) returns data carrying the labels its legend or alert text names. When the
leading replica dies, ZerolayerOperatorNoLeader fires until the standby takes the Lease. The runtime's
and auditor's queries are proved in tests/integration/runtime/test_observability_vllm.py."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.dashboard_queries import queries
from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id
from tests.helm_render import helm_binary, monitoring_objects
from tests.prometheus_proc import Prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
if shutil.which("prometheus") is None or helm_binary() is None:
    pytestmark.append(pytest.mark.skip(reason="no prometheus or Helm: scripts/setup.sh installs both (as root)"))

JOB = "zl-system/zl-zerolayer-operator"  # the chart's ServiceMonitor names its targets after the Service
POD = "zl-zerolayer-operator-0"  # the ServiceMonitor's pod label, given here by static labels


def test_every_operator_panel_and_rule_returns_data_and_the_no_leader_alert_fires_between_leaders(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-scrape-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    replicas = [OperatorProcess(cluster, namespace, run, tmp_path, identity=f"op-{n}-{run}", lease_seconds=15)
                for n in range(2)]
    chart = monitoring_objects("metrics.alerts.operatorNoLeader.for=0s", release="zl", namespace="zl-system")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(chart["PrometheusRule"]["spec"]))
    for replica in replicas:
        replica.start()
    prometheus = Prometheus(tmp_path, JOB, [f"127.0.0.1:{r.metrics_port}" for r in replicas], {"pod": POD}, rules)
    try:
        [node] = objects.add_nodes(1)
        objects.apply(objects.inference_node(f"{node}-inode", node))
        (leader,) = prometheus.wait("one replica leads", lambda: prometheus.query("zerolayer_operator_leader == 1"),
                                    timeout=90)
        assert leader["metric"]["pod"] == POD
        operator_side = [q for q in queries(chart) if q.operator]
        assert {q.what for q in operator_side} >= {"panel 'Operator: leader'", "rule ZerolayerOperatorNoLeader"}
        for query in operator_side:
            series = prometheus.wait(f"{query.what}: {query.expr}", lambda e=query.expr: prometheus.query(e),
                                     timeout=90)
            assert all(query.labels <= set(s["metric"]) for s in series), (query, series)
        # it may have fired before the first election: the rules are evaluated on their own interval
        prometheus.wait("no alert while a replica leads", lambda: not prometheus.firing("ZerolayerOperatorNoLeader"))
        assert float(prometheus.query("zerolayer:operator_leaders")[0]["value"][1]) == 1

        # the leader dies: until the standby takes the Lease (15 s) the scraped replicas have no leader
        (dead,) = [r for r in replicas if leader["metric"]["instance"].endswith(f":{r.metrics_port}")]
        dead.kill()
        prometheus.wait("ZerolayerOperatorNoLeader firing", lambda: prometheus.firing("ZerolayerOperatorNoLeader"))
        (survivor,) = [r for r in replicas if r is not dead]
        prometheus.wait("the standby leads", lambda: prometheus.query(
            f'zerolayer_operator_leader{{instance="127.0.0.1:{survivor.metrics_port}"}} == 1'), timeout=90)
        prometheus.wait("the alert resolved", lambda: not prometheus.firing("ZerolayerOperatorNoLeader"))
    finally:
        prometheus.stop()
        alive = next((r for r in replicas if r.alive()), None)
        objects.delete_all(alive)
        for replica in replicas:
            replica.stop()
