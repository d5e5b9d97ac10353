"""``zerolayer runtime --node-name N`` in cluster: serves what its InferenceNode says, to the tenants of
the cluster's TenantQuotas, and follows key rotation and quota removal without a restart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _apply(cluster, obj: dict) -> None:  # type: ignore[no-untyped-def]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def test_runtime_in_cluster_follows_tenant_quotas_and_secrets(cluster, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    node, tenant, secret = f"incluster-{suffix}", f"t-{suffix}", f"keys-{suffix}"
    _apply(cluster, {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode", "metadata": {"name": node},
                     "spec": {"nodeName": "gpu-node-0", "runtime": {"engine": "synthetic", "port": 18443},
                              "models": [{"name": "synth-e2e", "source": {"path": "/none"}}]}})
    _apply(cluster, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": "default"},
                     "stringData": {"api-keys": "sk-e2e-one\n"}})
    _apply(cluster, {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota", "metadata": {"name": tenant},
                     "spec": {"tenant": tenant, "apiKeySecretRef": {"name": secret, "namespace": "default"},
                              "namespaces": ["default"], "tokensPerMinute": 100000, "requestsPerMinute": 1000,
                              "allowedPriorities": ["high", "normal", "low"]}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli", "runtime", "--node-name", node, "--kubeconfig", cluster.kubeconfig,
         "--port", "0", "--tenant-sync-seconds", "0.5", "--tenant-namespace", "default", "--log-level", "WARNING"],
        env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "runtime exited before serving"
            if "serving on " in line:
                url = line.split("serving on ")[1].split()[0].replace("0.0.0.0", "127.0.0.1")
        assert url, "runtime did not start"
        body = json.dumps({"model": "synth-e2e", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})

        def status(key: str) -> int:
            return httpx.post(f"{url}/v1/messages", content=body, headers={"x-api-key": key}, timeout=10).status_code

        assert status("sk-e2e-one") == 200
        assert status("sk-e2e-two") == 401
        # Key rotation: the Secret changes, the running runtime follows.
        _apply(cluster, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": "default"},
                         "stringData": {"api-keys": "sk-e2e-two\n"}})
        cluster.wait_for(lambda: status("sk-e2e-two") == 200, timeout=30, what="rotated key accepted")
        assert status("sk-e2e-one") == 401
        # The quota goes away: so does the tenant.
        cluster.kubectl("delete", "tenantquota", tenant, "--wait=true")
        cluster.wait_for(lambda: status("sk-e2e-two") == 401, timeout=30, what="tenant removed")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        cluster.kubectl("delete", "tenantquota", tenant, "--ignore-not-found")
        cluster.kubectl("delete", "secret", secret, "-n", "default", "--ignore-not-found")
        cluster.kubectl("delete", "inferencenode", node, "--ignore-not-found")
