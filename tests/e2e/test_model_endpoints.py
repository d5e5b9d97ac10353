"""Issue 24 on the real local control plane: the operator makes one ClusterIP Service per served model over
every runtime pod serving it, and (with inference_pools on) one InferencePool that the real, vendored
Gateway API Inference Extension CRD accepts; both follow the InferenceNodes' models and go with the last
one. The endpoints are the kube-controller-manager's own EndpointSlices of the Service (kwok pods)."""

from __future__ import annotations

import pathlib

import pytest

from tests.e2e.operator_harness import Objects, OperatorProcess, new_run_id
from zerolayer.operator import manifests as m
from zerolayer.operator import model_plan as mp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

POOL_CRD = pathlib.Path(__file__).parents[2] / "crds/vendor/inference.networking.k8s.io_inferencepools.yaml"


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    had_crd = cluster.kubectl("get", "crd", mp.POOL_CRD, "--ignore-not-found", "-o", "name").stdout.strip()
    cluster.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
    cluster.wait_established(mp.POOL_CRD)
    run = new_run_id()
    namespace = f"zl-e2e-model-{run}"
    cluster.kubectl("create", "namespace", namespace)
    objects = Objects(cluster, namespace, run)
    operator = OperatorProcess(cluster, namespace, run, tmp_path_factory.mktemp("operator"),
                               env={"ZEROLAYER_INFERENCE_POOLS": "true", "ZEROLAYER_INFERENCE_POOL_EPP": "{pool}-epp"})
    operator.start()
    try:
        yield objects, operator
    finally:
        objects.delete_all(operator)
        operator.stop()
        if not had_crd:
            cluster.kubectl("delete", "crd", mp.POOL_CRD, "--wait=false", check=False)


def owners(obj):
    return sorted(r["name"] for r in (obj or {}).get("metadata", {}).get("ownerReferences") or ())


def ready_endpoints(objects, service):
    slices = objects.items("endpointslices", objects.namespace, f"kubernetes.io/service-name={service}")
    return sorted(e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or ()
                  if (e.get("conditions") or {}).get("ready"))


def test_one_service_and_pool_per_model_following_the_inference_nodes(cluster, env):
    objects, operator = env
    a_node, b_node = objects.add_nodes(2)
    a, b = f"a-{objects.run_id}", f"b-{objects.run_id}"
    models = [{"name": "tiny", "source": {"path": "/models/tiny"}}, {"name": "org/Big", "source": {"path": "/m/big"}}]
    objects.apply(objects.inference_node(a, a_node, models=models), objects.inference_node(b, b_node))
    tiny, big = mp.model_service_name("tiny"), mp.model_service_name("org/Big")

    service = cluster.wait_for(lambda: (s := objects.get("service", tiny, objects.namespace)) and owners(s) == [a, b]
                               and s, timeout=90, what="the tiny Service owned by both InferenceNodes")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["clusterIP"] not in ("", "None")
    assert service["spec"]["selector"] == {m.APP_LABEL: m.RUNTIME_APP, m.model_label_key("tiny"): m.MODEL_SERVED}
    assert service["spec"]["ports"][0]["targetPort"] == m.SERVING_PORT_NAME
    assert owners(cluster.wait_for(lambda: objects.get("service", big, objects.namespace), what="big")) == [a]

    # The API server validated the pool against the real CRD's schema when it accepted it.
    pool = cluster.wait_for(lambda: objects.get("inferencepool", tiny, objects.namespace), what="the tiny pool")
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": 8443}]
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{tiny}-epp"

    # The kube-controller-manager's EndpointSlices: both runtime pods behind the one Service.
    pods = cluster.wait_for(lambda: len(e := ready_endpoints(objects, tiny)) == 2 and e, timeout=120,
                            what="both runtime pods ready behind the tiny Service")
    assert all(p.startswith("zl-runtime-") for p in pods)
    assert len(ready_endpoints(objects, big)) == 1

    # b stops serving tiny: the Service keeps only a, and its pod leaves the endpoints once it rolls.
    objects.apply(objects.inference_node(b, b_node, models=[{"name": "other", "source": {"path": "/m/o"}}]))
    cluster.wait_for(lambda: owners(objects.get("service", tiny, objects.namespace)) == [a], what="tiny owned by a")
    cluster.wait_for(lambda: objects.get("service", mp.model_service_name("other"), objects.namespace),
                     what="the Service of b's new model")

    # The last InferenceNode serving tiny goes: its Service and pool go too.
    cluster.kubectl("delete", "inferencenode", a, "--wait=false")
    cluster.wait_for(lambda: objects.get("service", tiny, objects.namespace) is None
                     and objects.get("inferencepool", tiny, objects.namespace) is None,
                     timeout=90, what="the tiny Service and pool removed")
    log = operator.log()
    assert "Traceback" not in log, log[-3000:]

