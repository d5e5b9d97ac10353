"""Issue 3: SIGKILL the operator at random moments while it reconciles 20 InferenceNodes and
20 TenantQuotas, five times in a row; after the last restart there is exactly one of each
child, no orphans, every tenant's key hashes published exactly once, and everything is Ready."""

from __future__ import annotations

import base64
import collections
import json
import random
import time

import pytest

from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

COUNT = 20
KILLS = 5
MANAGED = "app.kubernetes.io/managed-by=zerolayer-operator"


@pytest.fixture
def env(cluster, tmp_path):
    run = new_run_id()
    namespace = f"zl-e2e-kill-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path)
    try:
        yield objects, operator
    finally:
        if not operator.alive():
            operator.start()
        objects.delete_all(operator)
        operator.stop()


def test_sigkill_five_times_leaves_exactly_one_of_each_child(cluster, env):
    objects, operator = env
    rng = random.Random()  # a fresh schedule every run; the seed is printed for reproduction
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    print(f"kill schedule seed {seed}")

    nodes = objects.add_nodes(COUNT)
    inodes = [f"{n}-inode" for n in nodes]
    tenants = [f"t{i}-{objects.run_id}" for i in range(COUNT)]
    docs = [objects.inference_node(name, node) for name, node in zip(inodes, nodes)]
    for i, t in enumerate(tenants):
        docs += [objects.secret(f"{t}-keys"), objects.tenant_quota(t, f"{t}-keys", namespaces=(f"team-{i}",))]

    operator.start()
    objects.apply(*docs)
    for _ in range(KILLS):
        time.sleep(rng.uniform(0.5, 4.0))  # anywhere from mid-creation to mid-status-update
        operator.kill()
        operator.start()

    def all_reconciled():
        inode_items = objects.items("inferencenodes", selector=f"zerolayer.io/e2e={objects.run_id}")
        tq_items = objects.items("tenantquotas", selector=f"zerolayer.io/e2e={objects.run_id}")
        ok = [o for o in inode_items if objects.condition(o, "RuntimeReady").get("status") == "True"
              and objects.condition(o, "NodeLabelled").get("status") == "True"]
        ready_tq = [o for o in tq_items if objects.condition(o, "Ready").get("status") == "True"]
        return (len(ok), len(ready_tq)) if len(ok) == COUNT and len(ready_tq) == COUNT else None
    cluster.wait_for(all_reconciled, timeout=240, interval=2, what="20 InferenceNodes and 20 TenantQuotas reconciled")

    for name in inodes:  # the runtimes' gossip (stand-in, see Objects.heartbeat)
        objects.heartbeat(name)
    cluster.wait_for(lambda: all(objects.condition(o, "Ready").get("status") == "True"
                                 for o in objects.items("inferencenodes", selector=f"zerolayer.io/e2e={objects.run_id}")),
                     timeout=120, interval=2, what="all InferenceNodes Ready")

    # exactly one of each child, named after its owner
    owners = {o["metadata"]["uid"]: o for o in objects.ours()}
    count = collections.Counter()
    model_services = []  # one per served model, owned by every InferenceNode that serves it
    for kind, namespace in (("daemonsets", objects.namespace), ("serviceaccounts", objects.namespace),
                            ("services", objects.namespace), ("networkpolicies", objects.namespace),
                            ("roles", objects.namespace), ("rolebindings", objects.namespace),
                            ("clusterroles", None), ("clusterrolebindings", None)):
        for child in objects.items(kind, namespace, selector=MANAGED):
            refs = child["metadata"].get("ownerReferences") or []
            if kind == "services" and child["metadata"]["name"].startswith("zl-model-"):
                model_services.append(child)
                continue
            if namespace is None and not any(r["uid"] in owners for r in refs) and \
                    not child["metadata"]["name"].startswith(tuple(f"zl-runtime-{n}" for n in inodes)):
                continue  # another run's cluster-scoped child
            assert len(refs) == 1 and refs[0]["uid"] in owners, f"orphan {kind} {child['metadata']['name']}"
            count[(kind, refs[0]["uid"])] += 1
    inode_uids = {uid for uid, o in owners.items() if o["kind"] == "InferenceNode"}
    assert [svc["metadata"]["name"] for svc in model_services] == ["zl-model-tiny"]

    def model_service_owned_by_all():  # its ownerReferences follow InferenceNodes as they are reconciled
        (svc,) = [c for c in objects.items("services", objects.namespace, selector=MANAGED)
                  if c["metadata"]["name"] == "zl-model-tiny"]
        return {r["uid"] for r in svc["metadata"].get("ownerReferences") or ()} == inode_uids or None
    cluster.wait_for(model_service_owned_by_all, timeout=60, interval=2, what="zl-model-tiny owned by every InferenceNode")
    per_inode = ("daemonsets", "serviceaccounts", "services", "networkpolicies", "roles", "rolebindings",
                 "clusterroles", "clusterrolebindings")
    per_tenant = ("networkpolicies",)  # runtimes read published hashes: no per-tenant Role any more
    for uid, owner in owners.items():
        kinds = per_inode if owner["kind"] == "InferenceNode" else per_tenant
        for kind in kinds:
            assert count[(kind, uid)] == 1, (owner["kind"], owner["metadata"]["name"], kind, count[(kind, uid)])
    assert sum(count.values()) == COUNT * len(per_inode) + COUNT * len(per_tenant)

    # One Secret of key hashes for the fleet, one entry per tenant, each tenant's own.
    keys = objects.items("secrets", objects.namespace, selector=MANAGED)
    assert [k["metadata"]["name"] for k in keys] == ["zl-tenant-keys"]
    entries = {k: json.loads(base64.b64decode(v)) for k, v in keys[0]["data"].items()}
    assert sorted(entries) == sorted(tenants)
    assert all(entries[t]["tenant"] == t and len(entries[t]["hashes"]) == 2 for t in tenants)

    pods = objects.items("pods", objects.namespace)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(nodes)
    for node in objects.items("nodes"):
        if node["metadata"]["name"] in nodes:
            assert node["metadata"]["labels"].get("zerolayer.io/inference-node") == "true"
    assert operator.starts == KILLS + 1
