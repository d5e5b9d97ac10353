"""A tenant's requests per minute hold across three runtimes hammered by concurrent clients, and a runtime
killed and restarted mid-window does not hand the tenant a fresh window (docs/fleet-scale.md)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
import time

import httpx
import pytest

from tests.e2e.operator_harness import new_run_id
from tests.e2e.runtime_fleet import (RuntimeProcess, inference_node, key_entry, keys_secret, start_all,
                                     tenant_quota)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LIMIT = 40  # requests per minute for the whole fleet


def max_in_window(times: list[float], window: float = 60.0) -> int:
    """The most events inside any interval of ``window`` seconds."""
    times, best, lo = sorted(times), 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


@pytest.fixture
def fleet(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-fq-{run}"
    tenant = f"fq-{run}"
    nodes = [f"fq-{run}-n{i}" for i in range(3)]
    cluster.kubectl("create", "namespace", namespace)
    docs = [inference_node(n, run) for n in nodes] + [
        tenant_quota(tenant, run, namespace, requestsPerMinute=LIMIT),
        keys_secret(namespace, {tenant: key_entry(tenant, [f"sk-{run}"])})]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    runtimes = [RuntimeProcess(cluster.kubeconfig, n, namespace, tmp_path, env=cluster.env()) for n in nodes]
    try:
        start_all(runtimes)
        yield tenant, f"sk-{run}", runtimes
    finally:
        for r in runtimes:
            r.stop()
        cluster.kubectl("delete", "tenantquota", tenant, "--wait=false", check=False)
        cluster.kubectl("delete", "inferencenodes", *nodes, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_requests_per_minute_hold_across_runtimes_and_restarts(cluster, fleet):
    tenant, key, runtimes = fleet
    body = json.dumps({"model": "synth", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    served: list[tuple[float, int]] = []  # (client time, runtime index) of every 200
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=10) as http:
            n = 0
            while not stop.is_set():
                index = (i + n) % len(runtimes)
                n += 1
                url = runtimes[index].url
                try:
                    status = http.post(f"{url}/v1/messages", content=body, headers={"x-api-key": key}).status_code
                except httpx.HTTPError:
                    status = 0  # the runtime being restarted
                if status == 200:
                    with lock:
                        served.append((time.monotonic(), index))
                else:
                    stop.wait(0.2)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        for i in range(24):
            pool.submit(client, i)
        # Phase 1: until the fleet has served most of the limit.
        cluster.wait_for(lambda: len(served) >= LIMIT // 2, timeout=60, what="the tenant is served")
        # Phase 2: the busiest runtime crashes and comes back while the window is still open.
        with lock:
            busiest = max(range(3), key=lambda k: sum(1 for _, idx in served if idx == k))
        runtimes[busiest].kill()
        runtimes[busiest].start()
        runtimes[busiest].wait_serving()
        before = len(served)
        cluster.wait_for(lambda: any(idx == busiest for _, idx in served[before:]) or
                         len(served) >= LIMIT, timeout=60, what="traffic after the restart")
        stop.wait(5)
        stop.set()
    times = [t for t, _ in served]
    # The bound (docs/fleet-scale.md): the limit plus one credit (5 %, at least 1 request) per node that used it.
    assert max_in_window(times) <= LIMIT + len(runtimes) * max(1, math.ceil(0.05 * LIMIT)), f"{max_in_window(times)} requests in one minute"
    quota = cluster.kubectl_json("get", "tenantquota", tenant)
    claims = quota["status"]["fleetQuota"]["nodes"]
    assert sum(c.get("requests", 0) for c in claims.values()) <= LIMIT
    assert set(claims) <= {r.node for r in runtimes}
