"""``zerolayer runtime --node-name N`` in cluster, with the real operator beside it: the runtime serves
what its InferenceNode says, to the tenants of the cluster's TenantQuotas, authenticating with the key
hashes the operator publishes (Secret ``zl-tenant-keys`` in the runtime namespace), and follows key
rotation and quota removal without a restart."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def env(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-rt-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path, resync=1.0)
    operator.start()
    try:
        yield objects, operator
    finally:
        objects.delete_all(operator)
        operator.stop()


def _published_tenants(objects: Objects) -> set[str]:
    """TenantQuota names with an entry in the operator's published key hashes."""
    secret = objects.get("secret", "zl-tenant-keys", objects.namespace) or {}
    return {name for name, raw in (secret.get("data") or {}).items() if json.loads(base64.b64decode(raw))}


def test_runtime_in_cluster_follows_tenant_quotas_and_secrets(cluster, env):
    objects, operator = env
    [node] = objects.add_nodes(1)
    inode, tenant, secret = f"{node}-inode", f"t-{objects.run_id}", f"keys-{objects.run_id}"
    objects.apply(
        objects.inference_node(inode, node, runtime={"engine": "synthetic", "port": 18443},
                               models=[{"name": "synth-e2e", "source": {"path": "/none"}}]),
        objects.secret(secret, "sk-e2e-one\n"),
        objects.tenant_quota(tenant, secret, namespaces=("default",), tokensPerMinute=100000,
                             requestsPerMinute=1000, allowedPriorities=["high", "normal", "low"]))
    # The runtime reads only what the operator publishes: wait for the tenant's entry first.
    cluster.wait_for(lambda: tenant in _published_tenants(objects), timeout=60,
                     what=f"operator publishes the key hashes of {tenant}\n{operator.log()[-3000:]}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli", "runtime", "--node-name", inode, "--kubeconfig", cluster.kubeconfig,
         "--port", "0", "--tenant-sync-seconds", "0.5", "--tenant-namespace", objects.namespace,
         "--log-level", "WARNING"],
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

        # 401 until the runtime's tenant sync has the key; then the node's first request for the
        # tenant is admitted under its quota credit (docs/fleet-scale.md).
        cluster.wait_for(lambda: status("sk-e2e-one") == 200, timeout=30, what="key accepted")
        assert status("sk-e2e-two") == 401
        # Key rotation: the tenant's Secret changes, the operator publishes the new hash, the
        # running runtime follows.
        objects.apply(objects.secret(secret, "sk-e2e-two\n"))
        cluster.wait_for(lambda: status("sk-e2e-two") == 200, timeout=30, what="rotated key accepted")
        assert status("sk-e2e-one") == 401
        # The quota goes away: so does the tenant.
        cluster.kubectl("delete", "tenantquota", tenant, "--wait=true")
        cluster.wait_for(lambda: status("sk-e2e-two") == 401, timeout=30, what="tenant removed")
        assert tenant not in _published_tenants(objects)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
