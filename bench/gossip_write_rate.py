"""API write rate of GPU-map gossip, steady state and under churn, on the local control plane.

    python bench/gossip_write_rate.py [--nodes 20] [--gpus 8] [--seconds 20]

N simulated runtimes (a *simulated* GPU source each, sampled every 200 ms by the runtime's
sampler; the real publisher and NodeApi) publish into N InferenceNodes. Three phases:

- steady: memory constant (heartbeats only);
- drift: each GPU's memory random-walks ±1.5 % per sample (memoryStep 5 % is crossed now and then);
- churn: each GPU's memory jumps anywhere in 30..99 % every sample (thresholds cross constantly).

Writes are counted by the API server itself (``apiserver_request_total`` for PATCH on
``inferencenodes/status``), and also by the publishers. The table compares them with a
publisher that patched on every sample (5/s per node) and with the configured cap
(``maxPatchesPerSecond`` per node). The cluster is reused when running, else brought up and
taken down again.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
import uuid

import yaml

from zerolayer.cluster.local import LocalCluster
from zerolayer.runtime.gossip import GossipPublisher, Load, RecordingSource
from zerolayer.runtime.gossip.kube import NodeApi
from zerolayer.runtime.gpu import GpuSampler, SimulatedGpuSource

SAMPLE_S = 0.2
_METRIC = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def api_status_patches(cluster: LocalCluster) -> float:
    """PATCH requests on inferencenodes/status the API server has answered (all codes)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = m.group("labels")
        if 'resource="inferencenodes"' in labels and 'subresource="status"' in labels and 'verb="PATCH"' in labels:
            total += float(m.group("value"))
    return total


class Node:
    def __init__(self, name: str, kubeconfig: str, gpus: int) -> None:
        self.source = SimulatedGpuSource.constant(0.5, gpus=gpus)
        self.gpus = gpus
        self.recording = RecordingSource(self.source)
        self.api = NodeApi(kubeconfig=kubeconfig)
        self.publisher = GossipPublisher(name, self.api, readings=lambda: self.recording.latest,
                                         load=lambda: Load(4, 1, 0.5), endpoint=f"http://{name}:8443")
        self.recording.on_sample = self.publisher.notify
        self.sampler = GpuSampler(self.recording, lambda s: None, interval_s=SAMPLE_S)
        self.memory = [0.5] * gpus

    def start(self) -> None:
        self.publisher.start()
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self.publisher.stop(final=False)
        self.api.close()


def drive(nodes: list[Node], mode: str, seconds: float, rng: random.Random) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for node in nodes:
            for g in range(node.gpus):
                if mode == "drift":
                    node.memory[g] = min(0.99, max(0.3, node.memory[g] + rng.uniform(-0.015, 0.015)))
                elif mode == "churn":
                    node.memory[g] = rng.uniform(0.3, 0.99)
                node.source.set_memory(node.memory[g], gpu=g)
        time.sleep(SAMPLE_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--heartbeat", type=int, default=10)
    parser.add_argument("--max-patches", type=float, default=2.0)
    args = parser.parse_args()

    cluster = LocalCluster(log=lambda m: print(f"[cluster] {m}", file=sys.stderr))
    started = cluster.up() == "started"
    names = [f"bench-gossip-{uuid.uuid4().hex[:4]}-{i}" for i in range(args.nodes)]
    docs = [{"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": n},
             "spec": {"nodeName": "gpu-node-0", "models": [{"name": "m", "source": {"path": "/m"}}],
                      "gossip": {"heartbeatSeconds": args.heartbeat, "maxPatchesPerSecond": args.max_patches}}}
            for n in names]
    nodes: list[Node] = []
    try:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))
        nodes = [Node(n, str(cluster.kubeconfig), args.gpus) for n in names]
        for node in nodes:
            node.start()
        time.sleep(3)  # first publications out of the way
        rng = random.Random(6)
        rows = []
        for mode in ("steady", "drift", "churn"):
            threads_before = sum(n.publisher.patches for n in nodes)
            api_before = api_status_patches(cluster)
            t0 = time.monotonic()
            drive(nodes, mode, args.seconds, rng)
            elapsed = time.monotonic() - t0
            api = api_status_patches(cluster) - api_before
            ours = sum(n.publisher.patches for n in nodes) - threads_before
            rate = api / elapsed
            every_sample = args.nodes / SAMPLE_S
            cap = args.nodes * args.max_patches
            rows.append((mode, args.nodes, args.gpus, f"{elapsed:.1f}", f"{api:.0f}", f"{ours}", f"{rate:.2f}",
                         f"{rate / args.nodes:.3f}", f"{rate / every_sample:.3f}", f"{rate / cap:.3f}"))
        failures = sum(n.publisher.failures for n in nodes)
    finally:
        for node in nodes:
            node.stop()
        cluster.kubectl("delete", "inferencenode", *names, "--wait=false", check=False)
        if started:
            cluster.down(quiet=True)

    header = ("phase", "nodes", "gpus/node", "seconds", "PATCH (apiserver)", "patches (publishers)",
              "writes/s", "per node/s", "vs every sample (5/s/node)", f"vs cap ({args.max_patches:g}/s/node)")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"GPU-map gossip API write rate (heartbeatSeconds={args.heartbeat}, memoryStep=0.05, "
          f"sample {SAMPLE_S * 1000:.0f} ms); failed patches: {failures}")
    for row in [header, *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
