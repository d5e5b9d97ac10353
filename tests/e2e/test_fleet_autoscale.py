"""Issue 25 end to end on the kwok fleet, runtimes as local processes (tests/e2e/fleet_rig.py): an
InferenceFleet of min 0 / max 3 goes 0 -> 1 on a first request (refused retryably by another runtime,
which gossips the demand), 1 -> 3 under load from an SDK client, back to 1 under a light load and to 0
when idle; every request the client sent is answered (each refusal on the way was retryable and the SDK
retried it), and the table shows each step's time and the fleet reconciler's API requests."""

from __future__ import annotations

import collections
import json
import time

import pytest

from tests.e2e.fleet_rig import FleetRig, LoadClient, fleet_doc
from tests.e2e.operator_harness import new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
RETRYABLE = {"MODEL_UNAVAILABLE", "RATE_LIMITED", "RESOURCE_EXHAUSTED", "REFUSED_STREAM", "APIConnectionError",
             "StreamRefused"}
AUTOSCALING = {"minReplicas": 0, "maxReplicas": 3, "metric": "runningRequests", "target": 4,
               "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 20}


@pytest.fixture
def rig(cluster, tmp_path):
    cluster.wait_established("inferencefleets.zerolayer.io")
    rig = FleetRig(cluster, new_run_id(), tmp_path).up()
    try:
        yield rig
    finally:
        rig.down()


class Steps:
    """Times each step from its start and counts the fleet reconciler's API requests in it."""

    def __init__(self, cluster, rig: FleetRig) -> None:
        self.cluster, self.rig, self.rows = cluster, rig, []

    def run(self, label: str, check, timeout: float, since: float | None = None) -> None:
        requests = self.rig.fleet_requests()
        start = time.monotonic() if since is None else since
        self.cluster.wait_for(check, timeout=timeout, interval=1.0, what=label)
        self.rows.append((label, time.monotonic() - start, self.rig.fleet_requests() - requests))

    def table(self) -> str:
        lines = [f"{'step':<58} {'seconds':>8} {'fleet API requests':>19}"]
        lines += [f"{label:<58} {secs:>8.1f} {int(reqs):>19}" for label, secs, reqs in self.rows]
        return "\n".join(lines)


def test_fleet_scales_0_1_3_1_0_and_every_request_is_answered(cluster, rig):
    name, model = f"auto-{rig.run}", f"tiny-{rig.run}"
    cluster.wait_for(lambda: rig.other in rig.supervisor.serving_at, timeout=120, what="the other runtime serving")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        fleet_doc(name, rig.run, model, autoscaling=AUTOSCALING, replicas=0)))
    cluster.wait_for(lambda: (rig.fleet(name).get("status") or {}).get("phase") == "Idle", timeout=60,
                     what="fleet idle at zero")
    load = LoadClient(cluster, rig.key, model, rig.selector)
    cluster.wait_for(lambda: rig.other in {n.name for n in load.node_map.nodes()}, timeout=30, what="the SDK's map")
    steps = Steps(cluster, rig)
    try:
        first = time.monotonic()
        load.concurrency = 1  # one client, one request at a time: the first finds no node serving the model
        steps.run("0 -> 1: first request -> InferenceNode created", lambda: rig.members(name), 60)
        steps.run("0 -> 1: first request -> first answer", lambda: load.outcomes, 150, since=first)
        load.concurrency = 12  # 12 streams of 2 s: runningRequests 12, target 4 a node
        loaded = time.monotonic()
        steps.run("1 -> 3: load -> 3 InferenceNodes created", lambda: len(rig.members(name)) == 3, 90)
        steps.run("1 -> 3: load -> 3 runtimes serving", lambda: len(rig.serving(name)) == 3, 150, since=loaded)
        time.sleep(10)  # served at 3 for a while
        load.concurrency = 2  # runningRequests 2: one node is enough
        steps.run("3 -> 1: light load -> 1 InferenceNode (down window 20 s)",
                  lambda: len(rig.members(name)) == 1, 180)
        load.concurrency = 0
        steps.run("1 -> 0: idle -> 0 (demand ages out after 120 s, window 20 s)",
                  lambda: not rig.members(name) and (rig.fleet(name).get("status") or {}).get("phase") == "Idle", 240)
    finally:
        load.close()
    retries = collections.Counter(load.retries)
    lost = [o for o in load.outcomes if not o.ok]
    print("\n" + steps.table())
    print(f"requests {len(load.outcomes)}, answered {len(load.outcomes) - len(lost)}, lost {len(lost)}; "
          f"retries by (code, reason): {dict(retries)}")
    print(f"operator API requests in all: {int(rig.all_requests())}; runtimes started {sorted(rig.supervisor.serving_at)}")
    assert not lost, lost[:3]
    assert all(code in RETRYABLE for code, _ in retries), retries
    assert retries[("MODEL_UNAVAILABLE", "model_wait")] >= 1  # the first request waited for the model
    assert rig.fleet(name)["spec"]["replicas"] == 0
