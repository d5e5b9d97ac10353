"""The real ``zerolayer runtime --node-name`` process gossips into its InferenceNode.

The runtime runs the synthetic engine with a *simulated* GPU source playing a scenario
(memory 50 % -> 97 % -> 50 %); the test watches the node's status through the gpumap reader:
admitting, then not, then again; SIGUSR1 (gpu-defragd's nudge) is answered without harm; on
SIGTERM the runtime publishes ``admitting: false`` before it exits. A request served meanwhile
is metered: its tenant and model get energy and a cost per 1k tokens at the node's price.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
import yaml

from zerolayer.gpumap import GpuMapWatcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_runtime_process_publishes_its_gpu_map(cluster, tmp_path):
    name = f"gossip-rt-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": name},
        "spec": {"nodeName": "gpu-node-0", "models": [{"name": "synthetic", "source": {"path": "/m"}}],
                 "gossip": {"heartbeatSeconds": 2, "staleAfterSeconds": 10, "maxPatchesPerSecond": 5},
                 "audit": {"electricityPricePerKWh": "0.36"}}}))
    scenario = tmp_path / "climb.yaml"
    scenario.write_text(yaml.safe_dump({"name": "climb-and-fall", "at_end": "hold", "gpus": [{"steps": [
        {"memory": 0.5, "samples": 25, "power_watts": 300}, {"memory": 0.97, "samples": 25, "power_watts": 650},
        {"memory": 0.5, "samples": 1, "power_watts": 400}]}]}))
    config = yaml.safe_load((REPO / "examples" / "standalone.yaml").read_text())
    config["listen"]["port"] = 0
    config["engine"].update(output_tokens=100, tokens_per_second=100)  # a 1 s stream spans several samples
    config["gpu"] = {"source": "simulated", "scenario": str(scenario)}
    config_path = tmp_path / "runtime.yaml"
    config_path.write_text(yaml.safe_dump(config))

    seen: list[bool] = []
    lock = threading.Lock()
    watcher: GpuMapWatcher

    def on_change() -> None:
        node = watcher.snapshot().node(name)
        if node is not None and node.heartbeat is not None:
            with lock:
                if not seen or seen[-1] != node.admitting:
                    seen.append(node.admitting)

    watcher = GpuMapWatcher(kubeconfig=cluster.kubeconfig, on_change=on_change)
    watcher.start()
    log = (tmp_path / "runtime.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "zerolayer.cli", "runtime", "--config", str(config_path),
                             "--node-name", name, "--kubeconfig", cluster.kubeconfig],
                            stdout=log, stderr=subprocess.STDOUT, env=cluster.env())
    try:
        cluster.wait_for(lambda: seen[-3:] == [True, False, True] if len(seen) >= 3 else None, timeout=60,
                         what=f"admitting True -> False -> True (seen {seen})")
        node = watcher.snapshot().node(name)
        assert node.endpoint.startswith("http://127.0.0.1:") and node.gpus_admitting == "1/1"

        reply = httpx.post(f"{node.endpoint}/v1/messages", timeout=30, json={
            "model": "synthetic", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "sk-zerolayer-demo", "x-zerolayer-priority": "high"})
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{node.endpoint}/metrics", timeout=30).text

        def metric(name: str) -> float:
            line = next(line for line in metrics.splitlines()
                        if line.startswith(name + '{') and 'tenant="demo"' in line and 'model="synthetic"' in line)
            return float(line.rsplit(" ", 1)[1])

        joules, tokens = metric("zerolayer_energy_joules_total"), metric("zerolayer_energy_tokens_total")
        assert joules > 100 and tokens > 50  # ~1 s at 400 W; 100 output tokens (+ prompt)
        assert metric("zerolayer_energy_cost_per_1k_tokens") == pytest.approx(
            joules / 3.6e6 * 0.36 / tokens * 1000, rel=1e-6)

        proc.send_signal(signal.SIGUSR1)
        cluster.wait_for(lambda: "SIGUSR1 from gpu-defragd" in (tmp_path / "runtime.log").read_text(),
                         timeout=20, what="the runtime's release log line")
        assert proc.poll() is None

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "runtime.log").read_text()
        status = cluster.kubectl_json("get", "inferencenode", name)["status"]
        assert status["admitting"] is False and status["gpusAdmitting"] == "0/1"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        watcher.stop()
        cluster.kubectl("delete", "inferencenode", name, "--wait=false", check=False)
