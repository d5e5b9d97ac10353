"""``zerolayer runtime --node-name N --api-processes 2`` in cluster (docs/api-processes.md): both API
processes serve the tenants the cluster defines, a tenant's fleet-wide requests per minute hold with
each process claiming under its own name, and process 0 alone gossips the node's status."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from tests.e2e.operator_harness import new_run_id
from tests.e2e.runtime_fleet import RuntimeProcess, inference_node, key_entry, keys_secret, tenant_quota
from tests.e2e.test_fleet_quota import max_in_window

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LIMIT = 30  # requests per minute for the tenant, fleet-wide


@pytest.fixture
def node(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-ap-{run}"
    tenant, name = f"ap-{run}", f"ap-{run}-n0"
    cluster.kubectl("create", "namespace", namespace)
    docs = [inference_node(name, run), tenant_quota(tenant, run, namespace, requestsPerMinute=LIMIT),
            keys_secret(namespace, {tenant: key_entry(tenant, [f"sk-{run}"])})]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    runtime = RuntimeProcess(cluster.kubeconfig, name, namespace, tmp_path, env=cluster.env(),
                             extra=["--api-processes", "2"])
    try:
        runtime.start()
        runtime.wait_serving(120)
        yield tenant, f"sk-{run}", runtime
    finally:
        runtime.stop()
        cluster.kubectl("delete", "tenantquota", tenant, "--wait=false", check=False)
        cluster.kubectl("delete", "inferencenodes", name, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_two_api_processes_hold_a_fleet_quota_and_one_gossips(cluster, node):
    tenant, key, runtime = node
    body = json.dumps({"model": "synth", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    served: list[float] = []
    lock, stop = threading.Lock(), threading.Event()

    def client() -> None:  # a connection of its own per request: the kernel spreads connections, not requests
        while not stop.is_set():
            with httpx.Client(timeout=10) as http:
                status = http.post(f"{runtime.url}/v1/messages", content=body, headers={"x-api-key": key}).status_code
            if status == 200:
                with lock:
                    served.append(time.monotonic())
            else:
                stop.wait(0.2)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(8):
            pool.submit(client)
        cluster.wait_for(lambda: len(served) >= LIMIT * 0.8, timeout=90, what="the tenant is served")
        stop.wait(10)
        stop.set()
    # The fleet bound (docs/fleet-scale.md) with each API process a claimant: the limit plus one credit each.
    assert max_in_window(served) <= LIMIT + 2, f"{max_in_window(served)} requests in one minute"
    quota = cluster.kubectl_json("get", "tenantquota", tenant)
    claims = quota["status"]["fleetQuota"]["nodes"]
    assert set(claims) <= {runtime.node, f"{runtime.node}/api-1"}, claims
    assert sum(c.get("requests", 0) for c in claims.values()) <= LIMIT
    # Process 0 publishes the node's status (gossip); the map it publishes is the node's.
    cluster.wait_for(lambda: "admitting" in (cluster.kubectl_json("get", "inferencenode", runtime.node)
                                             .get("status") or {}), timeout=60, what="the node's gossiped status")
    # ... with how many API processes serve it: the SDK opens that many connections to the node
    assert cluster.kubectl_json("get", "inferencenode", runtime.node)["status"].get("apiProcesses") == 2


def test_the_gossiped_prefix_digest_holds_what_either_process_served(cluster, node):
    """Two HTTP/2 clients, each with its own long system prompt: with exact connection balance each
    connection is served by another API process. Process 0 alone gossips, and the node's digest in
    InferenceNode.status holds both chats' blocks, process 1's published to it through the shared
    board (gossip/prefix_board.py). Before that board, process 1's prompts never reached the digest."""
    from zerolayer.prefix import PrefixDigest, chat_block_hashes

    _, key, runtime = node
    systems = ["zero layer, process zero " * 60, "another system prompt for process one " * 60]
    clients = [httpx.Client(http1=False, http2=True, timeout=30) for _ in systems]
    try:
        for client, system in zip(clients, systems):
            body = {"model": "synth", "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": "hi"}]}
            response = client.post(f"{runtime.url}/v1/messages", json=body, headers={"x-api-key": key})
            assert response.status_code == 200, response.text
    finally:
        for client in clients:
            client.close()
    wanted = [chat_block_hashes([("system", system), ("user", "hi")]) for system in systems]

    def both_held():
        status = cluster.kubectl_json("get", "inferencenode", runtime.node).get("status") or {}
        digest = PrefixDigest.decode((status.get("prefixCache") or {}).get("digest"))
        return digest is not None and all(digest.matched(blocks) == len(blocks) for blocks in wanted)
    cluster.wait_for(both_held, timeout=60, interval=1, what="both processes' chats in the gossiped prefix digest")
