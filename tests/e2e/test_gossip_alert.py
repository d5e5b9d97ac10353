"""Issue 30: a real ``zerolayer runtime --node-name`` gossips into its InferenceNode on the real API
server while a real Prometheus scrapes its metrics port with the chart's rules loaded; when the API
server stops taking its heartbeats (the InferenceNode is deleted: every patch now fails),
ZerolayerNodeNotGossiping fires for that pod."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from tests.helm_render import helm_binary, monitoring_objects
from tests.prometheus_proc import Prometheus, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
if shutil.which("prometheus") is None or helm_binary() is None:
    pytestmark.append(pytest.mark.skip(reason="no prometheus or Helm: scripts/setup.sh installs both (as root)"))

REPO = pathlib.Path(__file__).resolve().parents[2]
JOB = "zl-system/zl-zerolayer-runtime"  # the chart's PodMonitor job for release zl in zl-system


def test_the_gossip_alert_fires_when_the_api_server_stops_taking_heartbeats(cluster, tmp_path):
    name = f"alert-rt-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": name},
        "spec": {"nodeName": "gpu-node-0", "models": [{"name": "synthetic", "source": {"path": "/m"}}],
                 "gossip": {"heartbeatSeconds": 1, "staleAfterSeconds": 3}}}))
    config = yaml.safe_load((REPO / "examples" / "standalone.yaml").read_text())
    config["listen"]["port"] = 0
    config["gpu"] = {"source": "simulated", "memory": 0.5}
    (tmp_path / "runtime.yaml").write_text(yaml.safe_dump(config))
    rules = tmp_path / "rules.yaml"
    rule = monitoring_objects("metrics.alerts.nodeNotGossiping.for=0s", release="zl", namespace="zl-system")
    rules.write_text(yaml.safe_dump(rule["PrometheusRule"]["spec"]))
    metrics_port = free_port()
    log = (tmp_path / "runtime.log").open("w")
    runtime = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(tmp_path / "runtime.yaml"),
                                "--node-name", name, "--kubeconfig", cluster.kubeconfig,
                                "--metrics-port", str(metrics_port)], stdout=log, stderr=subprocess.STDOUT,
                               env=cluster.env())
    prometheus = Prometheus(tmp_path, JOB, [f"127.0.0.1:{metrics_port}"], {"pod": name}, rules)
    try:
        beats = 'zerolayer_gossip_patches_total{result="ok"}'
        prometheus.wait("heartbeats scraped", lambda: [s for s in prometheus.query(beats)
                                                       if float(s["value"][1]) >= 3], timeout=90)
        assert not prometheus.firing("ZerolayerNodeNotGossiping")
        cluster.kubectl("delete", "inferencenode", name, "--wait=true")
        (alert,) = prometheus.wait("ZerolayerNodeNotGossiping firing",
                                   lambda: prometheus.firing("ZerolayerNodeNotGossiping"), timeout=90)
        assert alert["labels"]["pod"] == name
        failed = prometheus.query('zerolayer_gossip_patches_total{result="failed"}')
        assert failed and float(failed[0]["value"][1]) > 0  # the runtime kept trying; the API server refused
        assert runtime.poll() is None  # alive and scraped: not a RuntimeDown case
    finally:
        prometheus.stop()
        runtime.terminate()
        runtime.wait(timeout=60)
        log.close()
        cluster.kubectl("delete", "inferencenode", name, "--ignore-not-found")
