"""Typed model sources in the runtime pod, the config hash that rolls it, and the reconciler's
handling of missing claims, missing token Secrets and failed downloads. No cluster."""

from __future__ import annotations

import copy
import datetime

import pytest

from zerolayer import models as model_layout
from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.reconcile import Reconciler, WaitingFor

from .fakes import FakeKube

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op", runtime_image="img:1")
NOW = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
HOST = {"name": "tiny", "source": {"hostPath": {"path": "/srv/models/tiny"}}, "default": True}
PVC = {"name": "org/big:v2", "source": {"pvc": {"claimName": "weights", "subPath": "big"}}}
HF = {"name": "hf", "source": {"huggingFace": {"repo": "org/name", "revision": "abc123",
                                               "tokenSecretRef": {"name": "hf-token", "key": "tok"},
                                               "endpoint": "http://mirror.test:8080"}}}
BAKED = {"name": "baked", "source": {"path": "/opt/model"}}


def inode(models, **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "gpu-node-0", "uid": "u-1", "generation": 1},
            "spec": {"nodeName": "gpu-node-0", "models": models, **spec}}


def pod_spec(ds):
    return ds["spec"]["template"]["spec"]


def server(ds):
    return next(c for c in pod_spec(ds)["containers"] if c["name"] == "server")


# --------------------------------------------------------------------------- volumes and mounts
def test_each_source_kind_is_mounted_read_only_at_its_container_path():
    ds = m.build_daemonset(inode([HOST, PVC, HF, BAKED]), CONFIG)
    volumes = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    mounts = {mt["mountPath"]: mt for mt in server(ds)["volumeMounts"]}

    assert volumes["model-0"]["hostPath"] == {"path": "/srv/models/tiny", "type": "Directory"}
    assert mounts["/models/tiny"] == {"name": "model-0", "mountPath": "/models/tiny", "readOnly": True}

    assert volumes["model-1"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    big = model_layout.container_path(PVC)
    assert big.startswith("/models/org-big-v2-") and mounts[big]["subPath"] == "big" and mounts[big]["readOnly"]

    assert volumes["model-cache"]["hostPath"] == {"path": "/var/lib/zerolayer/models", "type": "DirectoryOrCreate"}
    assert mounts["/models/hf"] == {"name": "model-cache", "mountPath": "/models/hf", "readOnly": True,
                                    "subPath": "org--name/abc123"}
    # a path source is inside the image: nothing mounted for it
    assert not any(mt["mountPath"].startswith("/opt") for mt in server(ds)["volumeMounts"])
    assert {e["name"]: e.get("value") for e in server(ds)["env"]}["HF_HUB_OFFLINE"] == "1"


def test_huggingface_source_gets_a_download_init_container_with_its_token_only_there():
    ds = m.build_daemonset(inode([HOST, HF]), CONFIG)
    (fetch,) = pod_spec(ds)["initContainers"]
    assert fetch["name"] == "fetch-model-1" and fetch["image"] == "img:1"
    assert fetch["args"] == ["fetch-model", "--repo=org/name", "--revision=abc123",
                             "--cache-dir=/var/lib/zerolayer/models", "--termination-log=/dev/termination-log",
                             "--endpoint=http://mirror.test:8080", "--token-file=/etc/zerolayer/hf-token/token"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    sc = fetch["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    token = next(v for v in pod_spec(ds)["volumes"] if v["name"] == "hf-token-1")
    assert token["secret"]["secretName"] == "hf-token"
    assert token["secret"]["items"] == [{"key": "tok", "path": "token"}]
    cache = next(mt for mt in fetch["volumeMounts"] if mt["name"] == "model-cache")
    assert cache == {"name": "model-cache", "mountPath": "/var/lib/zerolayer/models"}  # writable here only
    for c in pod_spec(ds)["containers"]:
        assert not any(mt["name"].startswith("hf-token") for mt in c.get("volumeMounts", ()))


def test_no_download_means_no_init_containers_and_legacy_strings_still_work():
    ds = m.build_daemonset(inode([{"name": "tiny", "source": "/m"}]), CONFIG)
    assert pod_spec(ds)["initContainers"] == []
    assert not any(v["name"].startswith("model") for v in pod_spec(ds)["volumes"])


def test_tls_secret_is_mounted_where_the_runtime_reads_it_and_probes_use_https():
    ds = m.build_daemonset(inode([HOST], runtime={"tlsSecretName": "serving-cert"}), CONFIG)
    assert {"name": "tls", "mountPath": "/etc/zerolayer/tls", "readOnly": True} in server(ds)["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "serving-cert"}} in pod_spec(ds)["volumes"]
    assert server(ds)["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


# --------------------------------------------------------------------------- the config hash
def _hash(models, **spec):
    return m.build_daemonset(inode(models, **spec), CONFIG)["spec"]["template"]["metadata"]["annotations"][
        m.CONFIG_HASH_ANNOTATION]


@pytest.mark.parametrize("change", [
    {"models": [HOST, BAKED]},
    {"models": [{**HOST, "source": {"hostPath": {"path": "/srv/models/other"}}}]},
    {"models": [{**HOST, "maxModelLen": 4096}]},
    {"runtime": {"engine": "synthetic"}},
    {"runtime": {"port": 9443}},
    {"runtime": {"tlsSecretName": "cert"}},
    {"runtime": {"kvCacheBytes": 1 << 30}},
    {"runtime": {"gpuMemoryUtilization": 0.8}},
    {"runtime": {"drainSeconds": 30}},
    {"scheduler": {"sampleIntervalMs": 100}},
    {"audit": {"electricityPricePerKWh": "0.30"}},  # an auditor argument (issue 27)
])
def test_hash_changes_with_what_the_runtime_reads_at_start(change):
    spec = {"models": [HOST]}
    assert _hash(**{**spec, **change}) != _hash(**spec)


@pytest.mark.parametrize("change", [
    {"scheduler": {"memoryThreshold": 0.8, "resumeThreshold": 0.7, "normalThreshold": 0.9,
                   "utilizationThreshold": 0.5, "maxPreemptionsPerTick": 5}},
    {"gossip": {"heartbeatSeconds": 3}},
    {"defrag": {"idleMinutes": 5}},
    {"scheduler": {"pressureSignal": "gpuMemory"}},
    {"gpuType": "H100"},
])
def test_hash_ignores_what_applies_live(change):
    assert _hash([HOST], **change) == _hash([HOST])


def test_migrating_a_legacy_string_to_a_typed_path_does_not_roll():
    assert _hash([{"name": "tiny", "source": "/m"}]) == _hash([{"name": "tiny", "source": {"path": "/m"}}])


# --------------------------------------------------------------------------- reconcile
def world(models):
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-0"}})
    body = copy.deepcopy(kube.put(inode(models)))  # what kopf hands over: a copy, not the stored object
    return kube, Reconciler(kube, CONFIG, now=lambda: NOW), body


def conditions(kube):
    obj = kube.find("zerolayer.io/v1alpha1", "InferenceNode", "gpu-node-0")
    return {c["type"]: c for c in obj["status"]["conditions"]}


def stored(kube):
    return copy.deepcopy(kube.find("zerolayer.io/v1alpha1", "InferenceNode", "gpu-node-0"))


async def test_missing_pvc_holds_the_pod_with_a_condition_and_one_warning():
    kube, rec, body = world([HOST, PVC])
    with pytest.raises(WaitingFor, match="PersistentVolumeClaim zl-run/weights"):
        await rec.reconcile_inference_node(body)
    assert kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run") is None
    assert kube.find("v1", "ServiceAccount", "zl-runtime-gpu-node-0", "zl-run") is not None
    models = conditions(kube)["ModelsReady"]
    assert (models["status"], models["reason"]) == ("False", "PVCNotFound")
    assert conditions(kube)["Ready"]["reason"] == "PVCNotFound"
    warnings = [e for e in kube.events if e[4]]
    assert [e[2] for e in warnings] == ["PVCNotFound", "PVCNotFound"]  # ModelsReady turned False, Ready flipped
    with pytest.raises(WaitingFor):  # again: no new warning
        await rec.reconcile_inference_node(stored(kube))
    assert len([e for e in kube.events if e[4]]) == 2

    kube.put({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights",
                                                                                  "namespace": "zl-run"}})
    await rec.reconcile_inference_node(stored(kube))
    assert kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run") is not None
    assert conditions(kube)["ModelsReady"]["status"] == "True"


async def test_an_edit_to_a_missing_pvc_keeps_the_serving_pod_as_it_was():
    kube, rec, body = world([HOST])
    await rec.reconcile_inference_node(body)
    before = copy.deepcopy(kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run"))
    edited = stored(kube)
    edited["spec"]["models"] = [{**HOST, "source": {"pvc": {"claimName": "weights"}}}]
    with pytest.raises(WaitingFor):
        await rec.reconcile_inference_node(edited)
    assert kube.find("apps/v1", "DaemonSet", "zl-runtime-gpu-node-0", "zl-run") == before


async def test_missing_token_secret_or_key_is_named():
    kube, rec, body = world([HOST, HF])
    with pytest.raises(WaitingFor, match="Secret zl-run/hf-token"):
        await rec.reconcile_inference_node(body)
    assert conditions(kube)["ModelsReady"]["reason"] == "TokenSecretNotFound"
    kube.secrets[("zl-run", "hf-token")] = {"other": "x"}
    with pytest.raises(WaitingFor):
        await rec.reconcile_inference_node(stored(kube))
    assert conditions(kube)["ModelsReady"]["reason"] == "TokenSecretKeyMissing"


def _pod(init_status):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "zl-runtime-gpu-node-0-abcde", "namespace": "zl-run",
                         "labels": m.runtime_selector("gpu-node-0")},
            "status": {"initContainerStatuses": [{"name": "fetch-model-1", **init_status}]}}


async def test_a_failed_download_is_a_condition_and_a_warning_with_the_fetchers_reason():
    kube, rec, body = world([HOST, HF])
    kube.secrets[("zl-run", "hf-token")] = {"tok": "hf_x"}
    with pytest.raises(WaitingFor, match="no runtime pod"):
        await rec.reconcile_inference_node(body)
    reason = "fetch-model: revision 'abc123' not found in repository org/name at http://mirror.test:8080"
    kube.put(_pod({"state": {"waiting": {"reason": "CrashLoopBackOff"}},
                   "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": reason + "\n"}}}))
    with pytest.raises(WaitingFor):
        await rec.reconcile_inference_node(stored(kube))
    models = conditions(kube)["ModelsReady"]
    assert (models["status"], models["reason"]) == ("False", "ModelDownloadFailed")
    assert models["message"].endswith(reason) and "fetch-model-1" in models["message"]
    assert conditions(kube)["Ready"]["reason"] == "ModelDownloadFailed"
    assert stored(kube)["status"]["phase"] == "Degraded"
    assert ("InferenceNode", "gpu-node-0", "ModelDownloadFailed", models["message"], True) in kube.events


@pytest.mark.parametrize("status, expected", [
    ({"state": {"running": {}}}, ("Unknown", "ModelDownloading")),
    ({"state": {"waiting": {"reason": "PodInitializing"}}}, ("Unknown", "ModelDownloadPending")),
    ({"state": {"terminated": {"exitCode": 0}}}, None),
    ({"state": {"terminated": {"exitCode": 1, "reason": "Error", "message": ""}}}, ("False", "ModelDownloadFailed")),
])
def test_fetch_progress_reads_init_container_states(status, expected):
    found = m.fetch_progress(_pod(status), {"fetch-model-1"})
    assert (found[:2] if found else None) == expected
