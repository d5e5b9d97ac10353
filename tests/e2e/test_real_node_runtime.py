"""The runtime pod the operator deploys runs for real on a real node (issue 13).

One module-wide setup on ``real-node-0`` (kubelet + containerd, kube-router enforcing
NetworkPolicies): the runtime image imported into the node's containerd, ``helm install`` of the
chart (the operator runs as a pod from that image), two TenantQuotas, and an InferenceNode that
serves the generated tiny Llama model from a hostPath with the real vLLM engine, with two API processes
(``spec.runtime.apiProcesses: 2``: one shared vLLM engine core per base model). Then, in order:
the pod with server, defragd and auditor ready; the official Anthropic SDK through the pod IP;
the NetworkPolicy truth table and how long a TenantQuota's deletion takes to revoke; a SIGKILLed
server restarted without losing an audited token; SIGTERM draining an in-flight stream; a model
change rolling the pod while a stream started before it completes (issue 25); and the
TLS roll with HTTPS probes and ALPN h2. Measured times are printed and summed up at the end
(docs/real-nodes.md).

Traffic goes only to addresses of this cluster's pods. Every wait is bounded and polls.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import anthropic
import httpx
import pytest

from tests.e2e import real_runtime_harness as h
from tests.e2e.real_node_harness import REAL_NODE, RealCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

RELEASE, OPERATOR_NS = "zl", "zerolayer-system"
RUNTIME_NS = f"{OPERATOR_NS}-runtime"  # the chart's default: <release namespace>-runtime
MONITORING_NS, OUTSIDER_NS = "monitoring", "outsider"
PORT, METRICS_PORT = 8443, 9464  # the chart's runtime.port and runtime.metricsPort
INODE = REAL_NODE  # one InferenceNode per node; named after it
MODEL = "tiny"
ADAPTER, SECOND = "tiny-sql", "tiny-b"  # a LoRA adapter on MODEL, and a second base model (its own engine)
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
POD_READY_S = 300  # vLLM in a pod was Ready in ~50 s; two shared cores, allow for a busy machine
SELECTOR = f"app.kubernetes.io/name=zerolayer-runtime,zerolayer.io/inference-node={INODE}"
API_PROCESSES = 2  # spec.runtime.apiProcesses of the InferenceNode below


@dataclasses.dataclass
class Tenant:
    quota: str  # TenantQuota name, also spec.tenant (unique per run: the node's audit store outlives clusters)
    namespace: str
    key: str


@dataclasses.dataclass
class Stack:
    cluster: RealCluster
    a: Tenant
    b: Tenant
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    model_path: pathlib.Path | None = None  # the tiny model's host folder (adapters are made for it)
    # What tenant a's clients received, summed over every answered request of this module.
    received: dict[str, int] = dataclasses.field(default_factory=lambda: {"input": 0, "output": 0, "requests": 0})
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def pod(self) -> dict:
        """The one Ready runtime pod (waits for it)."""
        def one():
            ready = [p for p in h.pods(self.cluster, RUNTIME_NS, SELECTOR) if h.ready(p)]
            return ready[0] if len(ready) == 1 else None
        try:
            return self.cluster.wait_for(one, timeout=POD_READY_S, interval=1, what="the runtime pod Ready")
        except AssertionError:
            self.explain()
            raise

    def explain(self) -> None:
        """Print why no runtime pod is Ready: each one's container states and the server's last lines."""
        for pod in h.pods(self.cluster, RUNTIME_NS, SELECTOR):
            name = pod["metadata"]["name"]
            for status in (pod.get("status") or {}).get("containerStatuses") or ():
                print(f"[explain] {name}/{status['name']}: ready={status.get('ready')} "
                      f"restarts={status.get('restartCount')} state={status.get('state')}")
            log = self.cluster.kubectl("logs", "-n", RUNTIME_NS, name, "-c", "server", "--tail=30", check=False)
            print(f"[explain] {name} server log:\n{log.stdout}{log.stderr}")

    def record(self, message) -> None:
        with self.lock:
            self.received["input"] += message.usage.input_tokens
            self.received["output"] += message.usage.output_tokens
            self.received["requests"] += 1


def _sdk_http_module():
    """The httpx module the installed anthropic SDK wants for ``http_client`` (httpx or httpx2)."""
    import importlib

    base = importlib.import_module("anthropic._base_client")
    return importlib.import_module("httpx2") if hasattr(base, "httpx2") else httpx


def _client(base_url: str, key: str, **kw) -> anthropic.Anthropic:
    # max_retries=2 is the SDK's default, as users run it: a node's first request for a tenant (and
    # the first after 10 s idle there) is a 429 with retry-after 1 s while the node claims its share
    # of the tenant's fleet-wide limit (docs/fleet-scale.md); the SDK waits and retries it.
    return anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=2, timeout=120, **kw)


def _ns_docs(*names: str) -> list[dict]:
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names]


def _api_server_endpoint(cluster: RealCluster) -> tuple[str, int]:
    """The API server's own address and port (the ``kubernetes`` EndpointSlice): what the runtime's
    egress policy must name, since kube-router matches egress after the Service's DNAT."""
    [eps] = cluster.kubectl_json("get", "endpointslices", "-n", "default",
                                 "-l", "kubernetes.io/service-name=kubernetes")["items"]
    return eps["endpoints"][0]["addresses"][0], int(eps["ports"][0]["port"])


def _condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == type_), {})


def _per_process(stack: "Stack", family: str, *labels: str) -> dict[str, float]:
    """A counter's samples summed per ``api_process`` on the pod's merged metrics page (the parent answers
    ``--metrics-port`` with every API process's series), read from inside the server container: the
    NetworkPolicy lets only the monitoring namespace reach the metrics port."""
    name = stack.pod()["metadata"]["name"]
    read = ("import urllib.request; "
            f"print(urllib.request.urlopen('http://127.0.0.1:{METRICS_PORT}/metrics', timeout=20).read().decode())")
    out = stack.cluster.kubectl("exec", "-n", RUNTIME_NS, name, "-c", "server", "--", "python3", "-c", read,
                                timeout=60)
    counts: dict[str, float] = {}
    for line in out.stdout.splitlines():
        if line.startswith(family + "{") and 'api_process="' in line and all(label in line for label in labels):
            index = line.split('api_process="')[1].split('"')[0]
            counts[index] = counts.get(index, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def _one_client_per_process(url: str, key: str) -> list:
    """``API_PROCESSES`` openai clients, each holding one open connection that exact connection balance
    (the default) handed to another API process: each client's first request is made while the earlier
    clients' connections are still open, so the parent gives it the process with the fewest."""
    import openai

    clients = [openai.OpenAI(base_url=url, api_key=key, max_retries=2, timeout=120) for _ in range(API_PROCESSES)]
    for client in clients:
        client.models.list()  # opens this client's connection (kept alive in its pool)
    return clients


@pytest.fixture(scope="module")
def stack(_real_cluster_session, tmp_path_factory):
    cluster: RealCluster = _real_cluster_session
    cluster.ensure_up()
    run = uuid.uuid4().hex[:6]
    tag = h.import_runtime_image(cluster)
    repo, _, version = tag.rpartition(":")
    models = h.model_dir()
    model = h.tiny_model(models)
    second = h.tiny_model(models, SECOND, seed=7, init_std=0.5)  # greedy output that is its own, not an echo
    adapter = h.tiny_adapter(models, model, ADAPTER)
    audit_existed = h.AUDIT_HOST_DIR.exists()
    adapters_existed = h.ADAPTERS_HOST_DIR.exists()  # the LoRA-on pod's hostPath (DirectoryOrCreate)
    a = Tenant(f"tenant-a-{run}", "tenant-a", f"sk-a-{uuid.uuid4().hex}")
    b = Tenant(f"tenant-b-{run}", "tenant-b", f"sk-b-{uuid.uuid4().hex}")
    s = Stack(cluster, a, b, model_path=model)
    api_ip, api_port = _api_server_endpoint(cluster)
    values = tmp_path_factory.mktemp("chart") / "values.json"
    values.write_text(json.dumps({
        "operator": {"image": {"repository": repo, "tag": version, "pullPolicy": "Never"},
                     "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}},
        "runtime": {"image": {"repository": repo, "tag": version, "pullPolicy": "Never"},
                    # the chart's default asks for 4 CPUs and 16 GiB; this node has 2 cores
                    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "8Gi"}},
                    "metricsScraperNamespaces": [MONITORING_NS],
                    "apiServerCIDRs": [f"{api_ip}/32"], "apiServerPorts": [api_port]},
    }))
    try:
        cluster.helm("install", RELEASE, str(h.CHART), "-n", OPERATOR_NS, "--create-namespace", "-f", str(values),
                     "--wait", "--timeout", "180s")
        cluster.apply(*_ns_docs(a.namespace, b.namespace, OUTSIDER_NS, MONITORING_NS))
        secrets = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"keys-{t.quota}", "namespace": RUNTIME_NS},
                    "type": "Opaque", "stringData": {"api-keys": t.key + "\n"}} for t in (a, b)]
        quotas = [{"apiVersion": h.API, "kind": "TenantQuota", "metadata": {"name": t.quota},
                   "spec": {"tenant": t.quota, "apiKeySecretRef": {"name": f"keys-{t.quota}", "namespace": RUNTIME_NS},
                            "namespaces": [t.namespace], "tokensPerMinute": 10_000_000, "requestsPerMinute": 100_000,
                            "maxConcurrentStreams": 16, "allowedPriorities": ["high", "normal", "low"]}}
                  for t in (a, b)]
        cluster.apply(*secrets, *quotas)
        gpus = int(cluster.kubectl_json("get", "node", REAL_NODE)["status"]["allocatable"]["nvidia.com/gpu"])
        inode = {"apiVersion": h.API, "kind": "InferenceNode", "metadata": {"name": INODE},
                 "spec": {"nodeName": REAL_NODE,
                          "models": [{"name": MODEL, "source": {"hostPath": {"path": str(model)}},
                                      "loras": [{"name": ADAPTER, "source": {"hostPath": {"path": str(adapter)}}}]},
                                     {"name": SECOND, "source": {"hostPath": {"path": str(second)}}}],
                          # CPU engine settings (the defaults target GPUs): no torch.compile (the image has
                          # no C++ compiler), float32 weights as the model was written. drainSeconds: the
                          # drain tests' 1500-token stream must end inside it; at 20 s it once did not, with
                          # two engines in the pod and another run busy on the same two cores.
                          # apiProcesses 2 (docs/api-processes.md): every test below runs against two API
                          # processes sharing one engine core per model (the 200m request would default to 1)
                          "runtime": {"engine": "vllm", "kvCacheBytes": 268435456, "gpus": gpus, "drainSeconds": 60,
                                      "enforceEager": True, "dtype": "float32", "apiProcesses": API_PROCESSES,
                                      "resources": {"requests": {"cpu": "200m", "memory": "512Mi"},
                                                    "limits": {"memory": "8Gi"}}},
                          # precise mode (issue 24): the gossiped digest follows vLLM's KV cache events
                          "gossip": {"prefixDigestSource": "kvEvents"}}}
        started = time.monotonic()
        cluster.apply(inode)
        s.pod()
        s.times["pod Ready after the InferenceNode was applied"] = time.monotonic() - started

        def inode_ready():
            return _condition(cluster.kubectl_json("get", "inferencenode", INODE), "Ready").get("status") == "True"
        cluster.wait_for(inode_ready, timeout=120, interval=1, what="InferenceNode Ready")
        s.times["InferenceNode Ready after it was applied"] = time.monotonic() - started
        yield s
    finally:
        _summary(s)
        cluster.kubectl("delete", "inferencenode", INODE, "--wait=false", check=False)
        try:
            cluster.wait_for(lambda: not h.pods(cluster, RUNTIME_NS, SELECTOR), timeout=90, interval=1,
                             what="the runtime pod gone") if cluster.local.is_running() else None
        finally:  # the host paths go whatever happened to the pod (the cluster's teardown stops it)
            cluster.kubectl("delete", "tenantquota", a.quota, b.quota, "--ignore-not-found", "--wait=false",
                            check=False)
            cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "60s", check=False)
            shutil.rmtree(models, ignore_errors=True)
            h.remove_if_created(h.AUDIT_HOST_DIR, audit_existed)
            h.remove_if_created(h.ADAPTERS_HOST_DIR, adapters_existed)


def _summary(s: Stack) -> None:
    print("\n== measured on the real node ==")
    for what, seconds in s.times.items():
        print(f"  {what}: {seconds:.1f}s")


# ---------------------------------------------------------------------------------------- 1, 2
def test_operator_runs_as_a_pod_on_the_real_node(stack):
    # the chart's default: two replicas, one leading (it holds the Lease), one standing by
    pods = h.pods(stack.cluster, OPERATOR_NS, "app.kubernetes.io/component=operator")
    assert len(pods) == 2 and all(h.ready(pod) for pod in pods)
    for pod in pods:
        assert pod["spec"]["nodeName"] == REAL_NODE
        assert pod["spec"]["containers"][0]["image"].endswith(":0.1.0-cpu")
        assert h.container_statuses(pod)["operator"]["restartCount"] == 0
        log = stack.cluster.kubectl("logs", "-n", OPERATOR_NS, pod["metadata"]["name"]).stdout
        assert "Traceback" not in log
    lease = json.loads(stack.cluster.kubectl("get", "lease", "-n", OPERATOR_NS, f"{RELEASE}-zerolayer-operator",
                                             "-o", "json").stdout)
    assert lease["spec"]["holderIdentity"] in {pod["metadata"]["name"] for pod in pods}


def test_runtime_pod_is_ready_with_server_defragd_and_auditor(stack):
    pod = stack.pod()
    assert pod["spec"]["nodeName"] == REAL_NODE
    statuses = h.container_statuses(pod)
    assert set(statuses) == {"server", "defragd", "auditor"}
    assert all(st["ready"] and "running" in st["state"] for st in statuses.values()), statuses
    server = next(c for c in pod["spec"]["containers"] if c["name"] == "server")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["scheme"] == "HTTP"
    inode = stack.cluster.kubectl_json("get", "inferencenode", INODE)
    assert _condition(inode, "RuntimeReady")["status"] == "True"
    assert inode["status"].get("apiProcesses") == API_PROCESSES  # gossiped by API process 0
    log = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, pod["metadata"]["name"], "-c", "server").stdout
    # one parent, two API processes, one shared vLLM engine core per base model (MODEL and SECOND)
    assert f"zerolayer runtime: {API_PROCESSES} API processes (pids " in log, log[-2000:]
    assert "2 vLLM engine cores (one per model)" in log, log[-2000:]
    for index in range(API_PROCESSES):
        assert f"API process {index}/{API_PROCESSES}: zerolayer runtime serving on" in log, log[-2000:]
    # The runtime publishes its GPU map (gossip) through the API server: egress to it is allowed.
    assert inode["status"].get("lastHeartbeat")
    name = pod["metadata"]["name"]
    auditor = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, name, "-c", "auditor").stdout
    defragd = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, name, "-c", "defragd").stdout
    print(f"auditor: {[line for line in auditor.splitlines() if 'source' in line or 'journal' in line][:3]}")
    print(f"defragd: {defragd.splitlines()[:1]}")


# ---------------------------------------------------------------------------------------- 3
def test_anthropic_sdk_answers_through_the_pod_ip(stack):
    pod = stack.pod()
    url = f"http://{pod['status']['podIP']}:{PORT}"
    with _client(url, stack.a.key) as client:
        message = client.messages.create(model=MODEL, max_tokens=16, messages=MESSAGES)
        stack.record(message)
        assert message.type == "message" and message.role == "assistant" and message.model == MODEL
        assert message.usage.input_tokens > 0 and 1 <= message.usage.output_tokens <= 16
        assert message.stop_reason in ("max_tokens", "end_turn")
        if message.stop_reason == "max_tokens":
            assert message.usage.output_tokens == 16
        with client.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        stack.record(final)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and final.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= final.usage.output_tokens <= 24
    with pytest.raises(anthropic.AuthenticationError):
        with _client(url, "sk-not-a-tenant") as client:
            client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    log = stack.cluster.kubectl("logs", "-n", RUNTIME_NS, pod["metadata"]["name"], "-c", "server").stdout
    assert (f"zerolayer runtime serving on http://0.0.0.0:{PORT} (engine: vllm, "
            f"models: {MODEL}, {ADAPTER}, {SECOND})") in log


def test_the_openai_sdk_through_the_models_service(stack):
    """Issue 24's plain-client path on the real node: the official openai SDK, no zerolayer code in the
    client, pointed at the model's one ClusterIP Service (``zl-model-<model>``, kube-proxy in iptables
    mode on the host, no proxy process) reaches the runtime pod. Tenant B's key: tenant A's tokens are
    summed for the billing check below."""
    import openai

    pod = stack.pod()
    cluster = stack.cluster

    def endpoints():
        slices = cluster.kubectl_json("get", "endpointslices", "-n", RUNTIME_NS,
                                      "-l", f"kubernetes.io/service-name=zl-model-{MODEL}")["items"]
        return {a for s in slices for e in s.get("endpoints") or () for a in e["addresses"]
                if (e.get("conditions") or {}).get("ready")}
    cluster.wait_for(lambda: pod["status"]["podIP"] in endpoints(), timeout=60, interval=1,
                     what=f"the runtime pod behind Service zl-model-{MODEL}")
    service = cluster.kubectl_json("get", "service", "-n", RUNTIME_NS, f"zl-model-{MODEL}")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == PORT
    url = f"http://{service['spec']['clusterIP']}:{PORT}/v1"
    with openai.OpenAI(base_url=url, api_key=stack.b.key, max_retries=2, timeout=120) as client:
        for _ in range(3):
            reply = client.chat.completions.create(model=MODEL, max_tokens=4, messages=MESSAGES)
            assert reply.model == MODEL and 1 <= reply.usage.completion_tokens <= 4
    print(f"openai SDK through Service zl-model-{MODEL} ({service['spec']['clusterIP']}:{PORT}): 3 answers")


def test_the_gossiped_prefix_digest_follows_vllm_kv_cache_events(stack):
    """Issue 24's precise mode on a cluster with the real engine: the InferenceNode asks for
    ``gossip.prefixDigestSource: kvEvents``. After one chat with a long system prompt, the digest the
    runtime gossips in the InferenceNode's status holds the chat's leading byte blocks, but not its
    last one: vLLM caches full token blocks only, and reports those in its KV cache events (the
    ``served`` record would hold every block of the chat). The reset side, where an eviction takes
    blocks out, is tests/integration/runtime/test_kv_events_vllm.py."""
    import openai

    from zerolayer.prefix import PrefixDigest, chat_block_hashes

    pod = stack.pod()
    system, question = "zero layer " * 120, "How much is it?"  # ~600 tokens: several full KV blocks
    blocks = chat_block_hashes([("system", system), ("user", question)])
    url = f"http://{pod['status']['podIP']}:{PORT}/v1"
    with openai.OpenAI(base_url=url, api_key=stack.b.key, max_retries=2, timeout=120) as client:
        reply = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    assert reply.usage.prompt_tokens > 500, reply.usage

    def held():
        status = stack.cluster.kubectl_json("get", "inferencenode", INODE).get("status") or {}
        digest = PrefixDigest.decode((status.get("prefixCache") or {}).get("digest"))
        matched = digest.matched(blocks) if digest is not None else 0
        return matched if matched >= 2 else None
    started = time.monotonic()
    matched = stack.cluster.wait_for(held, timeout=60, interval=1,
                                     what="the chat's leading blocks in the InferenceNode's gossiped prefix digest")
    stack.times["kvEvents digest: the chat's blocks in the InferenceNode status after the answer"] = \
        time.monotonic() - started
    print(f"gossiped digest (kvEvents) holds {matched} of the chat's {len(blocks)} byte blocks")
    assert matched < len(blocks), "the last byte block lies in a partial token block, which vLLM does not cache"


def test_two_models_and_an_adapter_served_by_one_pod(stack):
    """Each model of the InferenceNode has its own engine in the pod, the adapter runs on its base
    model's engine, and all three are listed, routed by name and published in status.models. Each of
    the pod's two API processes answers each of them (one shared engine core per base model)."""
    pod = stack.pod()
    url = f"http://{pod['status']['podIP']}:{PORT}/v1"
    before = _per_process(stack, "zerolayer_requests_total", 'route="completions"', 'status="200"')
    clients = _one_client_per_process(url, stack.b.key)
    answers: list[dict[str, str]] = []
    try:
        for client in clients:  # each API process, through the engine core each model has
            listed = {m.id: m for m in client.models.list().data}
            assert list(listed) == [MODEL, ADAPTER, SECOND]
            assert listed[ADAPTER].parent == MODEL and listed[SECOND].parent is None
            texts = {}
            for model in (MODEL, ADAPTER, SECOND):
                out = client.completions.create(model=model, prompt="The sea", max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert out.model == model and out.usage.completion_tokens == 8
                texts[model] = out.choices[0].text
            answers.append(texts)
    finally:
        for client in clients:
            client.close()
    after = _per_process(stack, "zerolayer_requests_total", 'route="completions"', 'status="200"')
    # Three answers from each API process: both serve every model and the adapter.
    assert {i: after.get(i, 0) - before.get(i, 0) for i in after} == {str(i): 3 for i in range(API_PROCESSES)}, \
        (before, after)
    # Three sets of weights, three greedy answers (the base model echoes the prompt's last token;
    # the adapter and the second model, with larger weights, write their own); the same from either
    # process, since they share the engine cores.
    texts = answers[0]
    assert len(set(texts.values())) == 3, texts
    assert all(other == texts for other in answers), answers
    status = stack.cluster.kubectl_json("get", "inferencenode", INODE)["status"]
    assert status["models"] == [MODEL, ADAPTER, SECOND]


def test_an_adapter_added_to_the_inferencenode_is_served_without_restarting_the_pod(stack):
    """Issue 25: an adapter put under the node's adapters directory and added to the InferenceNode is
    loaded into the running engine (vLLM's dynamic LoRA): listed and served by name by each API process
    (each runs its own InferenceNode watch; the adapter's id is the same in both, so the shared engine
    core loads it once), published in status.models, and the pod is the same (UID, restartCount,
    DaemonSet generation). Removed again, every API process refuses it by name, still without a restart."""
    import openai

    cluster, pod = stack.cluster, stack.pod()
    live = f"tiny-live-{uuid.uuid4().hex[:6]}"
    folder = h.tiny_adapter(h.ADAPTERS_HOST_DIR / live, stack.model_path, live)
    ds_name = pod["metadata"]["ownerReferences"][0]["name"]
    ds_generation = cluster.kubectl_json("get", "daemonset", "-n", RUNTIME_NS, ds_name)["metadata"]["generation"]

    def restarts(p: dict) -> dict[str, int]:
        return {c["name"]: c["restartCount"] for c in p["status"]["containerStatuses"]}
    before = restarts(pod)
    url = f"http://{pod['status']['podIP']}:{PORT}/v1"
    entry = {"name": live, "source": {"hostPath": {"path": str(folder)}}}
    try:
        started = time.monotonic()
        cluster.kubectl("patch", "inferencenode", INODE, "--type=json",
                        "-p", json.dumps([{"op": "add", "path": "/spec/models/0/loras/-", "value": entry}]))
        served = _per_process(stack, "zerolayer_requests_total", 'route="completions"', 'status="200"')
        clients = _one_client_per_process(url, stack.b.key)
        try:
            texts = []
            for client in clients:  # each API process runs its own InferenceNode watch and loads it
                cluster.wait_for(lambda: live in [m.id for m in client.models.list().data], timeout=120,
                                 interval=1, what="the new adapter listed by every API process")
                out = client.completions.create(model=live, prompt="The sea", max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert out.model == live and out.usage.completion_tokens == 8
                texts.append(out.choices[0].text)
            stack.times["adapter added -> listed and served by every API process"] = time.monotonic() - started
        finally:
            for client in clients:
                client.close()
        now = _per_process(stack, "zerolayer_requests_total", 'route="completions"', 'status="200"')
        assert {i: now.get(i, 0) - served.get(i, 0) for i in now} == {str(i): 1 for i in range(API_PROCESSES)}
        assert len(set(texts)) == 1, texts  # one adapter id, one set of weights in the shared engine core
        cluster.wait_for(lambda: live in (cluster.kubectl_json("get", "inferencenode", INODE).get("status") or {})
                         .get("models", ()), timeout=60, interval=1, what="the adapter in status.models")
    finally:
        current = cluster.kubectl_json("get", "inferencenode", INODE)["spec"]["models"][0].get("loras") or []
        index = next((i for i, a in enumerate(current) if a["name"] == live), None)
        if index is not None:
            cluster.kubectl("patch", "inferencenode", INODE, "--type=json",
                            "-p", json.dumps([{"op": "remove", "path": f"/spec/models/0/loras/{index}"}]))
    clients = _one_client_per_process(url, stack.b.key)
    try:
        for client in clients:  # every API process unloads it and refuses it by name
            cluster.wait_for(lambda: live not in [m.id for m in client.models.list().data], timeout=120,
                             interval=1, what="the removed adapter no longer listed by every API process")
            with pytest.raises(openai.APIStatusError) as refused:
                client.with_options(max_retries=0).completions.create(model=live, prompt="The sea", max_tokens=8)
            assert refused.value.status_code == 503 and live in str(refused.value)  # MODEL_UNAVAILABLE, by name
    finally:
        for client in clients:
            client.close()
    shutil.rmtree(h.ADAPTERS_HOST_DIR / live, ignore_errors=True)
    after = stack.pod()
    assert after["metadata"]["uid"] == pod["metadata"]["uid"] and restarts(after) == before
    assert cluster.kubectl_json("get", "daemonset", "-n", RUNTIME_NS, ds_name)["metadata"]["generation"] == \
        ds_generation


# ---------------------------------------------------------------------------------------- 6
def test_network_policy_truth_table_and_revocation(stack):
    cluster = stack.cluster
    ip = stack.pod()["status"]["podIP"]
    clients = {  # who: (namespace, serving allowed, metrics allowed) as the TenantQuotas and the chart declare
        "tenant A": (stack.a.namespace, True, False),
        "tenant B": (stack.b.namespace, True, False),
        "undeclared": (OUTSIDER_NS, False, False),
        "operator ns": (OPERATOR_NS, True, False),
        "monitoring": (MONITORING_NS, False, True),
    }
    cluster.apply(*(cluster.busybox_pod("probe", ns, "sleep 3600") for ns, _, _ in clients.values()))
    for ns, _, _ in clients.values():
        cluster.wait_running(ns, "probe")

    def observe():
        return {who: (h.reaches(cluster, ns, "probe", ip, PORT, "/healthz"),
                      h.reaches(cluster, ns, "probe", ip, METRICS_PORT, "/metrics"))
                for who, (ns, _, _) in clients.items()}

    expected = {who: (serve, metrics) for who, (_, serve, metrics) in clients.items()}
    last: list[dict] = [{}]

    def matches():  # type: ignore[no-untyped-def]
        last[0] = observe()
        return last[0] if last[0] == expected else None

    try:
        seen = cluster.wait_for(matches, timeout=60, interval=1, what=f"the NetworkPolicy truth table {expected}")
    except AssertionError as exc:
        policies = cluster.kubectl("get", "networkpolicy", "-A", "-o", "yaml", check=False).stdout
        raise AssertionError(f"{exc}\nlast observed: {last[0]}\npolicies:\n{policies}") from None
    print("\nNetworkPolicy truth table (runtime pod on the real node, kube-router enforcing)")
    print(f"  {'client namespace':<28} {'serving :%d' % PORT:<14} {'metrics :%d' % METRICS_PORT}")
    for who, (ns, _, _) in clients.items():
        serve, metrics = seen[who]
        print(f"  {who + ' (' + ns + ')':<28} {'allowed' if serve else 'denied':<14} {'allowed' if metrics else 'denied'}")

    started = time.monotonic()
    cluster.kubectl("delete", "tenantquota", stack.b.quota, "--wait=false")
    cluster.wait_for(lambda: not h.reaches(cluster, stack.b.namespace, "probe", ip, PORT, "/healthz"),
                     timeout=90, interval=0.5, what="tenant B's namespace to be denied")
    revoked = time.monotonic() - started
    stack.times["tenant B denied after its TenantQuota was deleted"] = revoked
    assert h.reaches(cluster, stack.a.namespace, "probe", ip, PORT, "/healthz")
    print(f"tenant B denied {revoked:.1f}s after `kubectl delete tenantquota`")


# ---------------------------------------------------------------------------------------- 5
def _billed(tenant: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "zerolayer.cli", "audit", "report", "--db",
                          str(h.AUDIT_HOST_DIR / "audit.db"), "--tenant", tenant, "--since", "1d", "--output", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    return {"input": sum(r["input_tokens"] for r in rows), "output": sum(r["output_tokens"] for r in rows),
            "requests": sum(r["requests"] for r in rows), "reconciled": sum(r["reconciled_tokens"] for r in rows)}


def _send(stack: Stack, count: int, max_tokens: int = 12) -> None:
    url = f"http://{stack.pod()['status']['podIP']}:{PORT}"
    with _client(url, stack.a.key) as client:
        for i in range(count):
            if i % 2:
                stack.record(client.messages.create(model=MODEL, max_tokens=max_tokens, messages=MESSAGES))
            else:
                with client.messages.stream(model=MODEL, max_tokens=max_tokens, messages=MESSAGES) as stream:
                    for _ in stream:
                        pass
                    stack.record(stream.get_final_message())


def test_killed_server_restarts_without_losing_an_audited_token(stack):
    cluster = stack.cluster
    _send(stack, 6)
    pod = stack.pod()
    name = pod["metadata"]["name"]
    restarts = h.container_statuses(pod)["server"]["restartCount"]
    time.sleep(1)  # past the 50 ms metering window: nothing of these requests is left unfired
    pid = h.container_pid(cluster, h.container_statuses(pod)["server"]["containerID"])
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    def restarted_and_ready():
        current = [p for p in h.pods(cluster, RUNTIME_NS, SELECTOR) if p["metadata"]["name"] == name]
        return current and h.container_statuses(current[0])["server"]["restartCount"] > restarts and h.ready(current[0])
    cluster.wait_for(restarted_and_ready, timeout=POD_READY_S, interval=1, what="the server restarted and Ready")
    stack.times["server Ready again after SIGKILL"] = time.monotonic() - killed
    _send(stack, 6)

    want = dict(stack.received)
    got = cluster.wait_for(lambda: (lambda b: b if (b["input"], b["output"]) == (want["input"], want["output"])
                                    else None)(_billed(stack.a.quota)), timeout=60, interval=1,
                           what=f"billed tokens of {stack.a.quota} to equal what its clients received ({want}); "
                                f"store says {_billed(stack.a.quota)}")
    print(f"tenant A: clients received {want}; the auditor's store billed {got}")
    assert got["requests"] == want["requests"]


# ---------------------------------------------------------------------------------------- 4, 7
class Stream(threading.Thread):
    """One long streaming request on its own thread; records when each text delta arrived."""

    def __init__(self, base_url: str, key: str, max_tokens: int, http_client=None):
        super().__init__(daemon=True)
        self.args = (base_url, key, max_tokens, http_client)
        self.arrivals: list[float] = []
        self.first = threading.Event()
        self.final = None
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        base_url, key, max_tokens, http = self.args
        try:
            with _client(base_url, key, **({"http_client": http} if http else {})) as client:
                with client.messages.stream(model=MODEL, max_tokens=max_tokens,
                                            messages=MESSAGES) as stream:
                    for event in stream:
                        self.events.append(event.type)
                        if event.type == "content_block_delta":
                            self.arrivals.append(time.monotonic())
                            self.first.set()
                    self.final = stream.get_final_message()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()


def _drain_check(stack: Stack, stream: Stream, disrupted_at: float, old_pod: str) -> None:
    stream.join(timeout=120)
    assert not stream.is_alive(), "the in-flight stream did not finish"
    assert stream.error is None, f"the in-flight stream broke: {stream.error!r}"
    final = stream.final
    stack.record(final)
    after = [t for t in stream.arrivals if t > disrupted_at]
    # It was still streaming when the pod began terminating, and it ended as a normal message.
    assert after, "no delta arrived after the pod began terminating: the stream ended too early to show a drain"
    assert stream.events[-1] == "message_stop" and final.stop_reason in ("max_tokens", "end_turn")
    print(f"in-flight stream on {old_pod}: {final.usage.output_tokens} tokens, {len(after)} deltas after the "
          f"pod began terminating, stop_reason {final.stop_reason}")


def _new_ready_pod(stack: Stack, old: str) -> dict:
    def fresh():
        ready = [p for p in h.pods(stack.cluster, RUNTIME_NS, SELECTOR) if h.ready(p)]
        return ready[0] if len(ready) == 1 and ready[0]["metadata"]["name"] != old else None
    return stack.cluster.wait_for(fresh, timeout=POD_READY_S, interval=1, what="a new runtime pod Ready")


def test_sigterm_drains_an_in_flight_stream(stack):
    pod = stack.pod()
    old = pod["metadata"]["name"]
    stream = Stream(f"http://{pod['status']['podIP']}:{PORT}", stack.a.key, max_tokens=1500)
    stream.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    deleted = time.monotonic()
    stack.cluster.kubectl("delete", "pod", "-n", RUNTIME_NS, old, "--wait=false")
    _drain_check(stack, stream, deleted, old)
    new = _new_ready_pod(stack, old)
    stack.times["new pod Ready after `kubectl delete pod` (drain + start)"] = time.monotonic() - deleted
    assert new["spec"]["nodeName"] == REAL_NODE


def _greedy(url: str, key: str, model: str) -> str:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=120) as client:
        out = client.completions.create(model=model, prompt="The sea", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert out.model == model and out.usage.completion_tokens == 8
    return out.choices[0].text


def test_a_model_change_rolls_the_pod_and_a_running_stream_completes(stack):
    """Issue 25 on the real node: the second model's weights change (same served name, a new folder):
    the runtime pod rolls, a stream started before the change completes on the old pod (it drains),
    and the new pod serves the new weights (another greedy answer) beside the unchanged model."""
    pod = stack.pod()
    old = pod["metadata"]["name"]
    url = f"http://{pod['status']['podIP']}:{PORT}"
    before = _greedy(url, stack.a.key, SECOND)  # tenant A: B's TenantQuota was deleted above
    changed = h.tiny_model(stack.model_path.parent, f"{SECOND}-v2", seed=11, init_std=0.5)
    stream = Stream(url, stack.a.key, max_tokens=1500)
    stream.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    patched = time.monotonic()
    stack.cluster.kubectl("patch", "inferencenode", INODE, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/models/1/source/hostPath/path", "value": str(changed)}]))
    _drain_check(stack, stream, patched, old)
    new = _new_ready_pod(stack, old)
    stack.times["model change: new pod Ready after the InferenceNode patch"] = time.monotonic() - patched
    new_url = f"http://{new['status']['podIP']}:{PORT}"
    after = _greedy(new_url, stack.a.key, SECOND)
    assert after != before, f"the new pod still answers with the old weights: {after!r}"
    _greedy(new_url, stack.a.key, MODEL)  # the unchanged model is served too


def test_tls_rolls_the_pod_and_serves_h2_over_tls(stack, tmp_path):
    cluster = stack.cluster
    pod = stack.pod()
    old = pod["metadata"]["name"]
    old_hash = pod["metadata"]["annotations"]["zerolayer.io/runtime-config-hash"]
    node = cluster.kubectl_json("get", "node", REAL_NODE)
    dns = [f"zl-runtime-{INODE}.{RUNTIME_NS}.svc", f"zl-runtime-{INODE}.{RUNTIME_NS}.svc.cluster.local"]
    ca, cert, key = h.make_tls(node["spec"]["podCIDR"], dns)
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                   "metadata": {"name": "runtime-tls", "namespace": RUNTIME_NS},
                   "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()}})
    stream = Stream(f"http://{pod['status']['podIP']}:{PORT}", stack.a.key, max_tokens=1500)
    stream.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    patched = time.monotonic()
    cluster.kubectl("patch", "inferencenode", INODE, "--type=merge",
                    "-p", json.dumps({"spec": {"runtime": {"tlsSecretName": "runtime-tls"}}}))
    _drain_check(stack, stream, patched, old)
    new = _new_ready_pod(stack, old)
    stack.times["TLS roll: new pod Ready after the InferenceNode patch"] = time.monotonic() - patched
    assert new["metadata"]["annotations"]["zerolayer.io/runtime-config-hash"] != old_hash
    server = next(c for c in new["spec"]["containers"] if c["name"] == "server")
    assert all(server[p]["httpGet"]["scheme"] == "HTTPS" for p in ("startupProbe", "readinessProbe", "livenessProbe"))

    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca)
    context = ssl.create_default_context(cafile=str(ca_file))
    url = f"https://{new['status']['podIP']}:{PORT}"
    with httpx.Client(verify=context, http2=True, timeout=60) as http:
        health = http.get(f"{url}/healthz")
        assert health.http_version == "HTTP/2" and health.status_code == 200
    # The SDK takes a client of the httpx flavour it was built on (newer releases: httpx2).
    sdk_http = _sdk_http_module()
    with sdk_http.Client(verify=context, http2=True, timeout=60) as http:
        with _client(url, stack.a.key, http_client=http) as client:
            raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=MESSAGES)
            assert raw.http_response.http_version == "HTTP/2"
            message = raw.parse()
            stack.record(message)
            assert 1 <= message.usage.output_tokens <= 8
            with client.messages.stream(model=MODEL, max_tokens=8, messages=MESSAGES) as s:
                types = [e.type for e in s]
                stack.record(s.get_final_message())
            assert types[-1] == "message_stop"
    with httpx.Client(verify=context, timeout=30) as http1:  # ALPN offers http/1.1 too
        assert http1.get(f"{url}/healthz").http_version == "HTTP/1.1"
    with pytest.raises(httpx.ConnectError):  # the certificate is checked: a client without the CA refuses it
        httpx.get(f"{url}/healthz", timeout=10)
