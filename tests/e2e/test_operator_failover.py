"""Issue 16: two operator replicas, one Lease. While the leader lives the standby writes nothing;
SIGKILL the leader in the middle of reconciling and the standby takes the Lease once it expires,
finishes the work, and nothing is done twice (each child created once, one creation event each).
A leader stopped cleanly releases the Lease, so its standby takes over without waiting it out."""

from __future__ import annotations

import collections
import re

import pytest

from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

COUNT = 12
LEASE = 6.0  # seconds: the leader renews every 2 s and stops acting if it has not for 4 s
MANAGED = "app.kubernetes.io/managed-by=zerolayer-operator"
_REQ = re.compile(r'^zerolayer_operator_api_requests_total\{code="(\d+)",resource="([^"]+)",verb="([^"]+)"\} (\S+)$')


def requests_by(operator: OperatorProcess) -> dict[tuple[str, str], float]:
    """The replica's own API requests so far, by (verb, resource)."""
    counts: dict[tuple[str, str], float] = collections.Counter()
    for line in (operator.get(operator.metrics_port, "/metrics") or "").splitlines():
        if m := _REQ.match(line):
            counts[(m.group(3), m.group(2))] += float(m.group(4))
    return dict(counts)


def lease(objects: Objects) -> dict:
    return objects.get("lease", "zerolayer-operator", objects.namespace) or {}


@pytest.fixture
def pair(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-fo-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    a = OperatorProcess(cluster, namespace, run, tmp_path, identity=f"a-{run}", lease_seconds=LEASE)
    b = OperatorProcess(cluster, namespace, run, tmp_path, identity=f"b-{run}", lease_seconds=LEASE)
    try:
        yield objects, a, b
    finally:
        survivor = b if b.alive() else a
        if not survivor.alive():
            survivor.start()
        objects.delete_all(survivor)
        a.stop()
        b.stop()


def test_standby_takes_over_from_a_killed_leader_and_nothing_acts_twice(cluster, pair):
    objects, a, b = pair
    a.start()
    cluster.wait_for(lambda: lease(objects).get("spec", {}).get("holderIdentity") == a.identity, timeout=60,
                     what="A holds the Lease")
    b.start()
    cluster.wait_for(lambda: "standing by" in b.log(), timeout=60, what="B standing by")

    nodes = objects.add_nodes(COUNT // 2)  # the other half joins only after the kill: work is left over
    late = [f"zl-e2e-{objects.run_id}-n{i}" for i in range(COUNT // 2, COUNT)]
    inodes = [f"{n}-inode" for n in nodes + late]
    tenants = [f"t{i}-{objects.run_id}" for i in range(COUNT)]
    docs = [objects.inference_node(name, node) for name, node in zip(inodes, nodes + late)]
    for i, t in enumerate(tenants):
        docs += [objects.secret(f"{t}-keys"), objects.tenant_quota(t, f"{t}-keys", namespaces=(f"team-{i}",))]
    objects.apply(*docs)
    # mid-reconcile: the first runtime DaemonSet exists, the rest of the fleet is still being made
    cluster.wait_for(lambda: objects.items("daemonsets", objects.namespace, selector=MANAGED), timeout=60,
                     interval=0.2, what="the leader's first DaemonSet")
    a.kill()
    before = requests_by(b)
    # while A led, B's only requests were reads of the Lease
    assert set(before) <= {("get", "leases")}, before
    objects.add_nodes(len(late))

    cluster.wait_for(lambda: lease(objects).get("spec", {}).get("holderIdentity") == b.identity, timeout=120,
                     what="B took the Lease")
    spec = lease(objects)["spec"]
    assert spec["leaseTransitions"] == 1 and spec["leaseDurationSeconds"] == round(LEASE)
    assert f"took the Lease {objects.namespace}/zerolayer-operator (previous holder: {a.identity})" in b.log()

    def converged():
        inode_items = objects.items("inferencenodes", selector=f"zerolayer.io/e2e={objects.run_id}")
        tq_items = objects.items("tenantquotas", selector=f"zerolayer.io/e2e={objects.run_id}")
        done = [o for o in inode_items if objects.condition(o, "RuntimeReady").get("status") == "True"]
        ready = [o for o in tq_items if objects.condition(o, "Ready").get("status") == "True"]
        return len(done) == COUNT and len(ready) == COUNT
    cluster.wait_for(converged, timeout=240, interval=2, what="B finished the fleet")

    # exactly one of each child, owned by its object
    owners = {o["metadata"]["uid"]: o for o in objects.ours()}
    count: collections.Counter = collections.Counter()
    model_services = []  # one per served model, owned by every InferenceNode that serves it
    for kind, namespace in (("daemonsets", objects.namespace), ("serviceaccounts", objects.namespace),
                            ("services", objects.namespace), ("networkpolicies", objects.namespace),
                            ("roles", objects.namespace), ("rolebindings", objects.namespace),
                            ("clusterroles", None), ("clusterrolebindings", None)):
        for child in objects.items(kind, namespace, selector=MANAGED):
            refs = [r["uid"] for r in child["metadata"].get("ownerReferences") or () if r["uid"] in owners]
            if kind == "services" and child["metadata"]["name"].startswith("zl-model-"):
                model_services.append((child["metadata"]["name"], set(refs)))
            elif refs:
                count[(kind, refs[0])] += 1
    assert set(count.values()) == {1}
    assert len(count) == COUNT * 8 + COUNT  # 8 children per InferenceNode, a NetworkPolicy per tenant
    inode_uids = {uid for uid, o in owners.items() if o["kind"] == "InferenceNode"}
    assert [name for name, _ in model_services] == ["zl-model-tiny"]

    def model_service_owned_by_all():  # its ownerReferences follow InferenceNodes as they are reconciled
        (svc,) = [c for c in objects.items("services", objects.namespace, selector=MANAGED)
                  if c["metadata"]["name"] == "zl-model-tiny"]
        return {r["uid"] for r in svc["metadata"].get("ownerReferences") or ()} == inode_uids or None
    cluster.wait_for(model_service_owned_by_all, timeout=60, interval=2, what="zl-model-tiny owned by every InferenceNode")

    # nothing acted twice: every child's creation was reported once, by whichever replica made it
    created: collections.Counter = collections.Counter()
    for name in inodes:
        for event in objects.events("InferenceNode", name):
            for part in event["message"].split("; "):
                if part.startswith("Created "):
                    created[part] += event.get("count", 1)
    assert created and max(created.values()) == 1, [k for k, v in created.items() if v > 1]
    reporters = {e.get("reportingInstance") for name in inodes for e in objects.events("InferenceNode", name)}
    assert reporters <= {a.identity, b.identity}
    assert b.identity in reporters  # B did part of the work


def test_a_cleanly_stopped_leader_hands_over_at_once(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-fo2-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    # a long Lease: the standby could only take it this soon because it was released
    a = OperatorProcess(cluster, namespace, run, tmp_path, identity=f"a-{run}", lease_seconds=300)
    b = OperatorProcess(cluster, namespace, run, tmp_path, identity=f"b-{run}", lease_seconds=300)
    try:
        a.start()
        cluster.wait_for(lambda: lease(objects).get("spec", {}).get("holderIdentity") == a.identity, timeout=60,
                         what="A holds the Lease")
        b.start()
        cluster.wait_for(lambda: "standing by" in b.log(), timeout=60, what="B standing by")
        a.stop()  # SIGTERM
        assert "released Lease" in a.log()
        cluster.wait_for(lambda: lease(objects).get("spec", {}).get("holderIdentity") == b.identity,
                         timeout=240, interval=1, what="B took the released Lease")
        assert "(previous holder: none)" in b.log()
    finally:
        a.stop()
        b.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
