"""Which mode the deployed auditor meters in, on a real node (issue 27).

One module-wide setup on ``real-node-0``: the runtime image imported into the node's containerd,
``helm install`` of the chart with its defaults for the auditor, one InferenceNode serving the
generated tiny model with the real vLLM engine. Then, in order:

1. a default install: the auditor holds no ``CAP_SYS_ADMIN``, and its pod names the mode it meters
   in (journal, on this kernel, and why) in the auditor's log and in ``kubectl describe pod``;
2. ``helm upgrade --set runtime.auditor.kernelMode=true``: the operator rolls the pod, the auditor
   gets ``CAP_SYS_ADMIN``, attaches in the kernel (``bpf mode``, in its log and its pod's Event), and
   after a SIGKILL of the server between requests every token the clients received is billed, from
   kernel events only (as tests/integration/audit/test_audit_end_to_end.py does outside a pod).

Traffic goes only to addresses of this cluster's pods. Every wait is bounded and polls.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import anthropic
import pytest

from tests.e2e import real_runtime_harness as h
from tests.e2e.real_node_harness import REAL_NODE, RealCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

RELEASE, OPERATOR_NS = "zl", "zerolayer-system"
RUNTIME_NS = f"{OPERATOR_NS}-runtime"
PORT = 8443
INODE = REAL_NODE
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
POD_READY_S = 300
SELECTOR = f"app.kubernetes.io/name=zerolayer-runtime,zerolayer.io/inference-node={INODE}"
KERNEL_MODE_ANNOTATION = "zerolayer.io/auditor-kernel-mode"  # operator/manifests.py AUDITOR_KERNEL_MODE_ANNOTATION


class Stack:
    def __init__(self, cluster: RealCluster, tenant: str, key: str) -> None:
        self.cluster, self.tenant, self.key = cluster, tenant, key
        self.received = {"input": 0, "output": 0, "requests": 0}
        self.times: dict[str, float] = {}
        self.values = None  # the chart values file of the install (the upgrade reuses it)

    def pod(self, kernel_mode: str) -> dict:
        """The one Ready runtime pod whose template asked for ``kernel_mode`` ("true"/"false")."""
        def one():
            ready = [p for p in h.pods(self.cluster, RUNTIME_NS, SELECTOR) if h.ready(p)
                     and p["metadata"].get("annotations", {}).get(KERNEL_MODE_ANNOTATION) == kernel_mode]
            return ready[0] if len(ready) == 1 else None
        return self.cluster.wait_for(one, timeout=POD_READY_S, interval=1,
                                     what=f"the runtime pod Ready with {KERNEL_MODE_ANNOTATION}={kernel_mode}")

    def send(self, pod: dict, count: int, max_tokens: int = 12) -> None:
        url = f"http://{pod['status']['podIP']}:{PORT}"
        with anthropic.Anthropic(base_url=url, api_key=self.key, max_retries=2, timeout=120) as client:
            for i in range(count):
                if i % 2:
                    message = client.messages.create(model=MODEL, max_tokens=max_tokens, messages=MESSAGES)
                else:
                    with client.messages.stream(model=MODEL, max_tokens=max_tokens, messages=MESSAGES) as stream:
                        for _ in stream:
                            pass
                        message = stream.get_final_message()
                self.received["input"] += message.usage.input_tokens
                self.received["output"] += message.usage.output_tokens
                self.received["requests"] += 1


@pytest.fixture(scope="module")
def stack(_real_cluster_session, tmp_path_factory):
    cluster: RealCluster = _real_cluster_session
    cluster.ensure_up()
    run = uuid.uuid4().hex[:6]
    tag = h.import_runtime_image(cluster)
    repo, _, version = tag.rpartition(":")
    models = h.model_dir()
    model = h.tiny_model(models)
    audit_existed = h.AUDIT_HOST_DIR.exists()
    s = Stack(cluster, f"tenant-k-{run}", f"sk-k-{uuid.uuid4().hex}")
    [eps] = cluster.kubectl_json("get", "endpointslices", "-n", "default",
                                 "-l", "kubernetes.io/service-name=kubernetes")["items"]
    values = tmp_path_factory.mktemp("chart") / "values.json"
    values.write_text(json.dumps({  # nothing about the auditor: the chart's default
        "operator": {"image": {"repository": repo, "tag": version, "pullPolicy": "Never"}, "replicas": 1,
                     "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}},
        "runtime": {"image": {"repository": repo, "tag": version, "pullPolicy": "Never"},
                    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "8Gi"}},
                    "apiServerCIDRs": [f"{eps['endpoints'][0]['addresses'][0]}/32"],
                    "apiServerPorts": [int(eps["ports"][0]["port"])]},
    }))
    s.values = values
    try:
        cluster.helm("install", RELEASE, str(h.CHART), "-n", OPERATOR_NS, "--create-namespace", "-f", str(values),
                     "--wait", "--timeout", "180s")
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tenant-k"}})
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"keys-{s.tenant}",
                                                                          "namespace": RUNTIME_NS},
                       "type": "Opaque", "stringData": {"api-keys": s.key + "\n"}},
                      {"apiVersion": h.API, "kind": "TenantQuota", "metadata": {"name": s.tenant},
                       "spec": {"tenant": s.tenant, "apiKeySecretRef": {"name": f"keys-{s.tenant}",
                                                                        "namespace": RUNTIME_NS},
                                "namespaces": ["tenant-k"], "tokensPerMinute": 10_000_000,
                                "requestsPerMinute": 100_000, "maxConcurrentStreams": 16,
                                "allowedPriorities": ["high", "normal", "low"]}})
        gpus = int(cluster.kubectl_json("get", "node", REAL_NODE)["status"]["allocatable"]["nvidia.com/gpu"])
        cluster.apply({"apiVersion": h.API, "kind": "InferenceNode", "metadata": {"name": INODE},
                       "spec": {"nodeName": REAL_NODE,
                                "models": [{"name": MODEL, "source": {"hostPath": {"path": str(model)}}}],
                                # CPU engine settings, as in test_real_node_runtime.py
                                "runtime": {"engine": "vllm", "kvCacheBytes": 268435456, "gpus": gpus,
                                            "drainSeconds": 10, "enforceEager": True, "dtype": "float32",
                                            "resources": {"requests": {"cpu": "200m", "memory": "512Mi"},
                                                          "limits": {"memory": "8Gi"}}}}})
        started = time.monotonic()
        s.pod("false")
        s.times["default install: pod Ready after the InferenceNode was applied"] = time.monotonic() - started
        yield s
    finally:
        print("\n== measured on the real node ==")
        for what, seconds in s.times.items():
            print(f"  {what}: {seconds:.1f}s")
        cluster.kubectl("delete", "inferencenode", INODE, "--wait=false", check=False)
        cluster.wait_for(lambda: not h.pods(cluster, RUNTIME_NS, SELECTOR), timeout=90, interval=1,
                         what="the runtime pod gone") if cluster.local.is_running() else None
        cluster.kubectl("delete", "tenantquota", s.tenant, "--ignore-not-found", "--wait=false", check=False)
        cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "60s", check=False)
        shutil.rmtree(models, ignore_errors=True)
        h.remove_if_created(h.AUDIT_HOST_DIR, audit_existed)


def _auditor(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "auditor")


def _mode_seen(stack: Stack, pod: dict, reason: str) -> tuple[str, str]:
    """(the auditor's mode line in its log, ``kubectl describe pod``) once the pod's Event ``reason`` is there."""
    name = pod["metadata"]["name"]

    def described():
        out = stack.cluster.kubectl("describe", "pod", "-n", RUNTIME_NS, name, check=False).stdout
        return out if reason in out else None
    try:
        describe = stack.cluster.wait_for(described, timeout=60, interval=1, what=f"Event {reason} on pod {name}")
    except AssertionError:
        log = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, name, "-c", "auditor", check=False).stdout
        raise AssertionError(f"no Event {reason} on {name}; the auditor's log:\n{log[-3000:]}") from None
    log = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, name, "-c", "auditor").stdout
    line = next((ln for ln in log.splitlines() if ln.startswith("zerolayer auditor: ")), "")
    return line, describe


def test_a_default_install_meters_from_the_journal_and_says_so(stack):
    pod = stack.pod("false")
    caps = _auditor(pod)["securityContext"]["capabilities"]["add"]
    assert "SYS_ADMIN" not in caps, caps
    line, describe = _mode_seen(stack, pod, "AuditorJournalMode")
    print(f"default install, auditor log: {line}")
    print("default install, kubectl describe pod:\n" + "\n".join(
        ln for ln in describe.splitlines() if "Auditor" in ln or KERNEL_MODE_ANNOTATION in ln))
    assert line.startswith("zerolayer auditor: journal mode, store"), line
    assert f"{KERNEL_MODE_ANNOTATION}: false" in describe


def _billed(tenant: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "audit", "report", "--db",
                          str(h.AUDIT_HOST_DIR / "audit.db"), "--tenant", tenant, "--since", "1d", "--output", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    return {"input": sum(r["input_tokens"] for r in rows), "output": sum(r["output_tokens"] for r in rows),
            "requests": sum(r["requests"] for r in rows), "reconciled": sum(r["reconciled_tokens"] for r in rows)}


def _sources(tenant: str) -> dict[str, int]:
    """Token events of ``tenant`` in the node's audit store, by the path that delivered them."""
    db = sqlite3.connect(f"file:{h.AUDIT_HOST_DIR / 'audit.db'}?mode=ro", uri=True, timeout=30)
    try:
        return dict(db.execute("SELECT source, count(*) FROM token_events WHERE tenant = ? GROUP BY source",
                               (tenant,)).fetchall())
    finally:
        db.close()


def test_kernel_mode_attaches_in_the_kernel_and_bills_every_token_across_a_sigkill(stack):
    cluster = stack.cluster
    old = stack.pod("false")["metadata"]["name"]
    started = time.monotonic()
    cluster.helm("upgrade", RELEASE, str(h.CHART), "-n", OPERATOR_NS, "-f", str(stack.values),
                 "--set", "runtime.auditor.kernelMode=true", "--wait", "--timeout", "180s")
    pod = stack.pod("true")
    assert pod["metadata"]["name"] != old
    stack.times["kernelMode=true: new pod Ready after helm upgrade"] = time.monotonic() - started
    caps = _auditor(pod)["securityContext"]["capabilities"]
    assert "SYS_ADMIN" in caps["add"] and caps["drop"] == ["ALL"], caps
    line, describe = _mode_seen(stack, pod, "AuditorKernelMode")
    print(f"kernelMode=true, auditor log: {line}")
    print("kernelMode=true, kubectl describe pod:\n" + "\n".join(
        ln for ln in describe.splitlines() if "Auditor" in ln or KERNEL_MODE_ANNOTATION in ln))
    assert line.startswith("zerolayer auditor: bpf mode, store"), line
    assert "bpf mode: in the kernel" in describe and f"{KERNEL_MODE_ANNOTATION}: true" in describe

    stack.send(pod, 6)
    restarts = h.container_statuses(pod)["server"]["restartCount"]
    time.sleep(1)  # past the 50 ms metering window: nothing of these requests is left unfired
    os.kill(h.container_pid(cluster, h.container_statuses(pod)["server"]["containerID"]), signal.SIGKILL)
    killed = time.monotonic()

    def restarted_and_ready():
        current = [p for p in h.pods(cluster, RUNTIME_NS, SELECTOR) if p["metadata"]["name"] == pod["metadata"]["name"]]
        return current and h.container_statuses(current[0])["server"]["restartCount"] > restarts and h.ready(current[0])
    cluster.wait_for(restarted_and_ready, timeout=POD_READY_S, interval=1, what="the server restarted and Ready")
    stack.times["kernelMode=true: server Ready again after SIGKILL"] = time.monotonic() - killed
    stack.send(stack.pod("true"), 6)

    want = dict(stack.received)
    got = cluster.wait_for(lambda: (lambda b: b if (b["input"], b["output"]) == (want["input"], want["output"])
                                    else None)(_billed(stack.tenant)), timeout=60, interval=1,
                           what=f"billed tokens of {stack.tenant} to equal what its clients received ({want}); "
                                f"store says {_billed(stack.tenant)}")
    sources = _sources(stack.tenant)
    print(f"kernelMode=true: clients received {want}; the auditor's store billed {got}; events by path {sources}")
    assert got["requests"] == want["requests"] and got["reconciled"] == 0
    assert set(sources) == {"bpf"}, sources  # every token came through the kernel, none from a journal
