"""Issue 25 on the real local control plane: an InferenceFleet keeps `replicas` InferenceNodes on
labelled kwok GPU nodes (owned like a ReplicaSet's pods, one per Node), `kubectl scale` moves it, and
with autoscaling it goes to zero when idle and back to one on demand a runtime recorded in its gossip.

No runtime processes here: the InferenceNodes' gossip is written by hand where a step needs it
(a fleet's InferenceNodes with no heartbeat count as drained: no runtime serves there)."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.operator_harness import API, E2E_LABEL, Objects, OperatorProcess, new_run_id
from zerolayer.cluster.local import node_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
POOL = "zerolayer.io/e2e-pool"


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    cluster.wait_established("inferencefleets.zerolayer.io")
    run = new_run_id()
    namespace = f"zl-e2e-fleet-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path_factory.mktemp("operator"))
    operator.start()
    try:
        yield objects, operator
    finally:
        cluster.kubectl("delete", "inferencefleets", "-l", f"{E2E_LABEL}={run}", "--wait=false", check=False)
        objects.delete_all(operator)
        # kopf puts its finalizer on fleets (for their timer); strip any the operator left behind.
        for obj in objects.items("inferencefleets", selector=f"{E2E_LABEL}={run}"):
            cluster.kubectl("patch", "inferencefleet", obj["metadata"]["name"], "--type=merge",
                            "-p", '{"metadata": {"finalizers": null}}', check=False)
        operator.stop()


def add_pool_nodes(objects: Objects, count: int) -> list[str]:
    names = [f"zl-e2e-{objects.run_id}-f{i}" for i in range(count)]
    docs = []
    for name in names:
        doc = node_manifest(name)
        doc["metadata"]["labels"][POOL] = objects.run_id
        docs.append(doc)
    objects.apply(*docs)
    objects.nodes += names
    return names


def fleet(objects: Objects, name: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "InferenceFleet",
            "metadata": {"name": name, "labels": {E2E_LABEL: objects.run_id}},
            "spec": {"nodeSelector": {POOL: objects.run_id},
                     "models": [{"name": f"tiny-{objects.run_id}", "source": {"path": "/models/tiny"}}],
                     "runtime": {"resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}, **spec}}


def api_requests(operator: OperatorProcess) -> dict[tuple[str, str], float]:
    """The operator's own API requests so far, by (verb, resource)."""
    text = operator.get(operator.metrics_port, "/metrics") or ""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("zerolayer_operator_api_requests_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["verb"].strip('"'), labels["resource"].strip('"'))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def members(objects: Objects, name: str) -> list[dict]:
    return objects.items("inferencenodes", selector=f"zerolayer.io/fleet={name}")


def live(objects: Objects, name: str) -> list[dict]:
    return [x for x in members(objects, name) if not x["metadata"].get("deletionTimestamp")]


def test_fleet_places_replicas_and_kubectl_scale_removes_one(cluster, env):
    objects, operator = env
    pool = add_pool_nodes(objects, 3)
    objects.add_nodes(1)  # an unlabelled GPU node the fleet must not use
    name = f"fleet-{objects.run_id}"
    objects.apply(fleet(objects, name, replicas=2))

    two = cluster.wait_for(lambda: (m := live(objects, name)) and len(m) == 2 and m, timeout=60,
                           what="2 InferenceNodes of the fleet")
    uid = objects.get("inferencefleet", name)["metadata"]["uid"]
    nodes = sorted(x["spec"]["nodeName"] for x in two)
    assert nodes == sorted(pool)[:2]  # eligible Nodes in name order, one each
    for x in two:
        ref = x["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceFleet", uid, True)
        assert x["metadata"]["name"] == f"{name}-{x['spec']['nodeName']}"
        assert x["metadata"]["labels"][E2E_LABEL] == objects.run_id  # the --selector operator handles it
        assert x["spec"]["models"][0]["name"] == f"tiny-{objects.run_id}"
    status = cluster.wait_for(lambda: (s := (objects.get("inferencefleet", name) or {}).get("status") or {})
                              and s.get("replicas") == 2 and s, timeout=30, what="fleet status replicas 2")
    assert status["selector"] == f"zerolayer.io/fleet={name}" and status["observedGeneration"] >= 1
    table = cluster.kubectl("get", "inferencefleet", name).stdout
    print("\n" + table)
    assert "DESIRED" in table and "SERVING" in table

    # The scale subresource: what kubectl scale (and HPA/KEDA) use.
    scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/zerolayer.io/v1alpha1/inferencefleets/{name}/scale").stdout)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == f"zerolayer.io/fleet={name}"
    cluster.kubectl("scale", "inferencefleet", name, "--replicas=1")
    one = cluster.wait_for(lambda: (m := live(objects, name)) and len(m) == 1 and m, timeout=60,
                           what="fleet scaled to 1")
    assert one[0]["spec"]["nodeName"] in nodes
    cluster.wait_for(lambda: (objects.get("inferencefleet", name) or {}).get("status", {}).get("replicas") == 1,
                     timeout=30, what="fleet status replicas 1")

    # Its Node leaves the cluster: the InferenceNode is replaced on another labelled Node.
    gone = one[0]["spec"]["nodeName"]
    cluster.kubectl("delete", "node", gone)
    started = time.monotonic()
    [again] = cluster.wait_for(lambda: (m := [x for x in live(objects, name) if x["spec"]["nodeName"] != gone])
                               and len(live(objects, name)) == 1 and m, timeout=120, what="replacement on another Node")
    assert again["spec"]["nodeName"] in pool
    print(f"Node {gone} deleted -> replaced on {again['spec']['nodeName']} in {time.monotonic() - started:.1f} s")

    # Steady: a minute of fleet looks (every 10 s) costs no API request for the fleet or its InferenceNodes.
    cluster.wait_for(lambda: (objects.get("inferencefleet", name) or {}).get("status", {}).get("nodes")
                     == [again["spec"]["nodeName"]], timeout=30, what="status caught up")
    time.sleep(12)
    before = api_requests(operator)
    time.sleep(60)
    spent = {k: v - before.get(k, 0) for k, v in api_requests(operator).items() if v != before.get(k, 0)}
    print(f"steady fleet, 60 s: operator API requests by (verb, resource): {spent or 'none'}")
    # (A fleet that writes would first list InferenceNodes and Nodes, and patch its status.)
    assert not [k for k in spent if k[1].startswith("inferencefleets") or k[1] == "nodes"
                or (k[1] == "inferencenodes" and k[0] != "get")], spent


def test_autoscaled_fleet_goes_to_zero_when_idle_and_back_on_recorded_demand(cluster, env):
    objects, operator = env
    pool = add_pool_nodes(objects, 2)
    name = f"auto-{objects.run_id}"
    model = f"tiny-{objects.run_id}"
    # Idle from the start and no down window: the fleet goes to zero at its first looks.
    objects.apply(fleet(objects, name, replicas=1, autoscaling={
        "minReplicas": 0, "maxReplicas": 2, "scaleDownStabilizationSeconds": 0}))
    cluster.wait_for(lambda: (objects.get("inferencefleet", name) or {}).get("status", {}).get("phase") == "Idle"
                     and not members(objects, name), timeout=90, what="fleet idle at zero")
    assert objects.get("inferencefleet", name)["spec"]["replicas"] == 0

    # Another runtime (a hand-written InferenceNode's gossip) refused a request for the fleet's model.
    other = f"{name}-other"
    taken = [n for n in pool][-1]
    objects.apply(objects.inference_node(other, taken))
    cluster.wait_for(lambda: objects.get("inferencenode", other), timeout=30, what="the other InferenceNode")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    demanded = time.monotonic()
    cluster.kubectl("patch", "inferencenode", other, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"demand": [{"model": model, "requests": 1, "lastRequested": stamp}]}}))
    [made] = cluster.wait_for(lambda: (m := live(objects, name)) and m, timeout=60, what="fleet scaled from zero")
    reaction = time.monotonic() - demanded
    assert made["spec"]["nodeName"] != taken  # never two on one Node
    body = objects.get("inferencefleet", name)
    assert body["spec"]["replicas"] == 1
    events = [e["reason"] for e in objects.events("InferenceFleet", name)]
    assert "Scaled" in events
    print(f"\nscale from zero: demand written -> InferenceNode created in {reaction:.1f} s")


def test_example_fleet_is_accepted_by_the_api_server(cluster, env):
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "examples/inferencefleet.yaml").stdout
    assert "inferencefleet.zerolayer.io/tiny-llama created (server dry run)" in out


@pytest.mark.parametrize("spec,words", [
    ({"replicas": -1}, ["spec.replicas", "greater than or equal to 0"]),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, ["minReplicas must not exceed maxReplicas"]),
    ({"autoscaling": {"maxReplicas": 2, "metric": "tokensPerSecond"}}, ["spec.autoscaling.metric", "Unsupported value"]),
    ({"models": []}, ["spec.models", "at least 1"]),
])
def test_api_server_refuses_an_invalid_fleet_readably(cluster, env, spec, words):
    objects, _ = env
    doc = fleet(objects, "invalid-probe", **spec)
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
    assert out.returncode != 0 and all(w in out.stderr for w in words), out.stderr
