"""Several in-cluster runtimes as local processes against a local control plane, without the operator.

Used by tests/e2e/test_fleet_quota.py and the benches bench/fleet_quota.py and bench/runtime_api_load.py.
The operator's one job the runtimes depend on, publishing key hashes into ``zl-tenant-keys``, is done
here (:func:`keys_secret`, the same entry format as ``operator/manifests.py build_tenant_key_entry``),
so the API requests a bench counts are the runtimes' own.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable

API = "zerolayer.io/v1alpha1"
LABEL = "zerolayer.io/fleet-test"


def key_entry(tenant: str, keys: Iterable[str], created: str = "") -> str:
    hashes = sorted(hashlib.sha256(k.encode()).hexdigest() for k in keys)
    document = {"tenant": tenant, "created": created, "hashes": hashes}
    return base64.b64encode(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).decode()


def keys_secret(namespace: str, entries: dict[str, str]) -> dict:
    """``zl-tenant-keys`` with ``entries`` (TenantQuota name -> :func:`key_entry`)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": "zl-tenant-keys", "namespace": namespace}, "data": dict(entries)}


def inference_node(name: str, run: str, model: str = "synth") -> dict:
    return {"apiVersion": API, "kind": "InferenceNode", "metadata": {"name": name, "labels": {LABEL: run}},
            "spec": {"nodeName": name, "models": [{"name": model, "source": {"path": "/none"}}],
                     "runtime": {"engine": "synthetic", "port": 18443, "gpus": 0},
                     "gossip": {"heartbeatSeconds": 30, "staleAfterSeconds": 90}}}


def tenant_quota(name: str, run: str, namespace: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "TenantQuota", "metadata": {"name": name, "labels": {LABEL: run}},
            "spec": {"tenant": name, "apiKeySecretRef": {"name": "unused", "namespace": namespace},
                     "namespaces": ["default"], "tokensPerMinute": 100000, "requestsPerMinute": 1000,
                     "allowedPriorities": ["high", "normal", "low"], **spec}}


class RuntimeProcess:
    """``zerolayer runtime --node-name NODE`` in a child process; :attr:`url` once it serves."""

    def __init__(self, kubeconfig: str, node: str, namespace: str, log_dir: pathlib.Path,
                 extra: Iterable[str] = (), env: dict[str, str] | None = None) -> None:
        self.kubeconfig, self.node, self.namespace = kubeconfig, node, namespace
        self.log_path = log_dir / f"runtime-{node}.log"
        self.extra = list(extra)
        self.env = dict(env or os.environ, KUBECONFIG=kubeconfig)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> "RuntimeProcess":
        self.url = None
        self._close()
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli", "runtime", "--node-name", self.node, "--kubeconfig",
             self.kubeconfig, "--port", "0", "--tenant-namespace", self.namespace, "--log-level", "INFO",
             *self.extra], env=self.env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        return self

    def wait_serving(self, timeout: float = 90) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"runtime {self.node} exited: see {self.log_path}")
            if "serving on " in line:
                self.url = line.split("serving on ")[1].split()[0].replace("0.0.0.0", "127.0.0.1")
                threading.Thread(target=self._drain, daemon=True).start()
                return self.url
        raise AssertionError(f"runtime {self.node} did not serve within {timeout}s")

    def _drain(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        try:
            for _ in proc.stdout:
                pass
        except ValueError:  # closed by stop() after the process ended
            pass

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (no final claim release, no goodbye)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc is not None and self.proc.poll() is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if getattr(self, "_log", None) is not None:
            self._log.close()


def start_all(runtimes: list[RuntimeProcess], timeout: float = 120) -> list[str]:
    for r in runtimes:
        r.start()
    return [r.wait_serving(timeout) for r in runtimes]


# --------------------------------------------------------------------------- counting the runtimes' API requests
_DISPATCHED = re.compile(r'^apiserver_flowcontrol_dispatched_requests_total\{(?P<l>[^}]*)\} (?P<v>\S+)$')
_REQUESTS = re.compile(r'^apiserver_request_total\{(?P<l>[^}]*)\} (?P<v>\S+)$')


def runtime_identity(cluster, namespace: str, name: str, workdir: pathlib.Path) -> pathlib.Path:
    """A ServiceAccount for the runtimes and a FlowSchema matching only it, so the API server counts
    their requests apart (``apiserver_flowcontrol_dispatched_requests_total{flow_schema=name}``);
    returns a kubeconfig that authenticates as it. ``cluster`` has ``kubectl(...)`` and ``kubeconfig``."""
    import yaml

    cluster.kubectl("create", "serviceaccount", name, "-n", namespace)
    cluster.kubectl("create", "clusterrolebinding", name, "--clusterrole=cluster-admin",
                    f"--serviceaccount={namespace}:{name}")
    schema = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
              "spec": {"priorityLevelConfiguration": {"name": "workload-high"}, "matchingPrecedence": 500,
                       "distinguisherMethod": {"type": "ByUser"},
                       "rules": [{"subjects": [{"kind": "ServiceAccount",
                                                "serviceAccount": {"name": name, "namespace": namespace}}],
                                  "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                     "clusterScope": True, "namespaces": ["*"]}],
                                  "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(schema))
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=4h").stdout.strip()
    config = yaml.safe_load(pathlib.Path(cluster.kubeconfig).read_text())
    config["users"] = [{"name": name, "user": {"token": token}}]
    for ctx in config["contexts"]:
        ctx["context"]["user"] = name
    path = workdir / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def api_metrics(cluster) -> str:
    return cluster.kubectl("get", "--raw", "/metrics").stdout


def dispatched(text: str, schema: str) -> float:
    """Requests the API server dispatched for ``schema`` (watches included, counted when they start)."""
    return sum(float(m.group("v")) for line in text.splitlines()
               if (m := _DISPATCHED.match(line)) and f'flow_schema="{schema}"' in m.group("l"))


def requests_by(text: str, resources: Iterable[str]) -> dict[str, float]:
    """``apiserver_request_total`` summed by "VERB resource[/subresource]" for ``resources`` (all clients)."""
    wanted, out = set(resources), {}
    for line in text.splitlines():
        m = _REQUESTS.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("l")))
        if labels.get("resource") in wanted:
            key = f"{labels.get('verb')} {labels['resource']}" + (f"/{labels['subresource']}"
                                                                 if labels.get("subresource") else "")
            out[key] = out.get(key, 0.0) + float(m.group("v"))
    return out
