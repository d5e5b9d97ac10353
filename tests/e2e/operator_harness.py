"""Shared pieces of the operator's e2e tests: the operator as a local process, object
factories, kwok nodes of our own, and cleanup that leaves the shared cluster as it found it.

The operator runs as ``python -m zerolayer.cli operator`` against the local API server with
``--selector zerolayer.io/e2e=<run>``, so it only touches this run's objects, and every
namespaced child lands in this run's runtime namespace.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

from zerolayer.cluster.local import node_manifest

API = "zerolayer.io/v1alpha1"
E2E_LABEL = "zerolayer.io/e2e"
RUNTIME_KINDS = ("daemonset", "serviceaccount", "service", "networkpolicy")
CLUSTER_KINDS = ("clusterrole", "clusterrolebinding")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """``zerolayer operator`` as a child process, with its log in a file.

    It elects itself leader through the Lease in its namespace like the chart's pods do; its
    identity is stable across restarts (as a pod's name is across container restarts) unless
    ``identity`` names another replica. ``resync``: the full-resync period (drift repair must
    not depend on it, so tests leave it at an hour)."""

    def __init__(self, cluster, namespace: str, run_id: str, log_dir: pathlib.Path, resync: float = 3600.0,
                 identity: str | None = None, lease_seconds: float | None = None,
                 env: dict[str, str] | None = None):
        self.cluster, self.namespace, self.run_id = cluster, namespace, run_id
        self.extra_env = dict(env or {})  # the chart's ZEROLAYER_* settings
        self.identity = identity or f"op-{run_id}"
        self.log_path = log_dir / f"operator-{run_id}-{self.identity}.log"
        self.resync, self.lease_seconds = resync, lease_seconds
        self.proc: subprocess.Popen | None = None
        self.health_port = self.metrics_port = 0
        self.starts = 0
        self.kubeconfig = cluster.kubeconfig

    def start(self) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "zerolayer.cli", "operator", "--kubeconfig", self.kubeconfig,
               "--runtime-namespace", self.namespace, "--selector", f"{E2E_LABEL}={self.run_id}",
               "--resync-seconds", str(self.resync), "--health-port", str(self.health_port),
               "--metrics-port", str(self.metrics_port), "--leader-identity", self.identity]
        if self.lease_seconds:
            cmd += ["--lease-seconds", str(self.lease_seconds)]
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts} =====\n")
        log.flush()
        env = dict(self.cluster.env(), ZEROLAYER_RUNTIME_RESOURCES='{"requests": {"cpu": "100m", "memory": "128Mi"}}',
                   **self.extra_env)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no cleanup, no graceful shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get(self, port: int, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


class Objects:
    """Factories and readers for this run's custom resources and children."""

    def __init__(self, cluster, namespace: str, run_id: str):
        self.cluster, self.namespace, self.run_id = cluster, namespace, run_id
        self.nodes: list[str] = []

    # ---- writes
    def apply(self, *docs: dict) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                   "items": list(docs)}))

    def add_nodes(self, count: int) -> list[str]:
        names = [f"zl-e2e-{self.run_id}-n{len(self.nodes) + i}" for i in range(count)]
        self.apply(*(node_manifest(n) for n in names))
        self.nodes += names
        return names

    def inference_node(self, name: str, node: str, **spec) -> dict:
        return {"apiVersion": API, "kind": "InferenceNode",
                "metadata": {"name": name, "labels": {E2E_LABEL: self.run_id}},
                "spec": {"nodeName": node, "models": [{"name": "tiny", "source": {"path": "/models/tiny"}}],
                         "runtime": {"resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}},
                         # heartbeats are written by hand here: keep them fresh for the whole test
                         "gossip": {"heartbeatSeconds": 10, "staleAfterSeconds": 3600}, **spec}}

    def secret(self, name: str, keys: str | None = None) -> dict:
        """An API-key Secret; by default two keys of its own (the operator refuses a key that an
        older TenantQuota already holds, so tenants never share the default keys)."""
        keys = f"{name}-key-one\n{name}-key-two\n" if keys is None else keys
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": self.namespace},
                "type": "Opaque", "stringData": {"api-keys": keys}}

    def tenant_quota(self, name: str, secret: str, namespaces=("team-x",), **spec) -> dict:
        return {"apiVersion": API, "kind": "TenantQuota",
                "metadata": {"name": name, "labels": {E2E_LABEL: self.run_id}},
                "spec": {"tenant": name, "apiKeySecretRef": {"name": secret, "namespace": self.namespace},
                         "namespaces": list(namespaces), "tokensPerMinute": 1000, "requestsPerMinute": 60, **spec}}

    def heartbeat(self, name: str) -> None:
        """Stand-in for the runtime's GPU-map gossip (runtimes on kwok nodes are records, not
        processes): write status.lastHeartbeat as the runtime would."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.cluster.kubectl("patch", "inferencenode", name, "--subresource=status", "--type=merge",
                             "-p", json.dumps({"status": {"lastHeartbeat": now}}))

    # ---- reads
    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        args = ["get", kind, name, "-o", "json", "--ignore-not-found"]
        if namespace:
            args += ["-n", namespace]
        out = self.cluster.kubectl(*args).stdout.strip()
        return json.loads(out) if out else None

    def items(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        args = ["get", kind, "-o", "json"]
        args += ["-n", namespace] if namespace else []
        args += ["-l", selector] if selector else []
        return json.loads(self.cluster.kubectl(*args).stdout)["items"]

    def ours(self) -> list[dict]:
        """InferenceNodes and TenantQuotas of this run."""
        return self.items("inferencenodes", selector=f"{E2E_LABEL}={self.run_id}") + \
            self.items("tenantquotas", selector=f"{E2E_LABEL}={self.run_id}")

    @staticmethod
    def condition(obj: dict | None, type_: str) -> dict:
        for c in ((obj or {}).get("status") or {}).get("conditions") or ():
            if c["type"] == type_:
                return c
        return {}

    def events(self, kind: str, name: str) -> list[dict]:
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        return json.loads(self.cluster.kubectl("get", "events", "-A", "--field-selector", selector,
                                               "-o", "json").stdout)["items"]

    # ---- cleanup
    def delete_all(self, operator: OperatorProcess | None) -> None:
        """Delete this run's resources while the operator runs (finalizers), then strip any
        finalizer left behind so nothing hangs, and remove our nodes and namespace."""
        for kind in ("inferencenodes", "tenantquotas"):
            self.cluster.kubectl("delete", kind, "-l", f"{E2E_LABEL}={self.run_id}", "--wait=false", check=False)
        deadline = time.monotonic() + (60 if operator and operator.alive() else 0)
        while time.monotonic() < deadline and self.ours():
            time.sleep(1)
        for obj in self.ours():
            self.cluster.kubectl("patch", obj["kind"].lower(), obj["metadata"]["name"], "--type=merge",
                                 "-p", '{"metadata": {"finalizers": null}}', check=False)
        if self.nodes:
            self.cluster.kubectl("delete", "node", *self.nodes, "--wait=false", check=False)
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)


def new_run_id() -> str:
    return uuid.uuid4().hex[:6]
