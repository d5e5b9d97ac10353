"""An autoscaled InferenceFleet on the kwok control plane with its runtimes as local processes.

Used by tests/e2e/test_fleet_autoscale.py and bench/fleet_autoscale.py. kwok's pods are records, not
processes, so :class:`RuntimeSupervisor` plays the kubelet's part for the fleet: one ``zerolayer
runtime --node-name <InferenceNode>`` per InferenceNode the operator creates, stopped (SIGTERM, so it
drains) when the operator deletes it. The runtimes are synthetic engines paced by a base config
(``tokens_per_second``), so each request holds a stream for a while and the load they gossip moves the
autoscaler. :class:`LoadClient` is the SDK under test: a ``Client`` on a ``KubernetesNodeMap`` of this
run's InferenceNodes, with a number of concurrent workers the test sets per phase.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import threading
import time
from typing import Any

from tests.e2e.operator_harness import API, E2E_LABEL, OperatorProcess
from tests.e2e.runtime_fleet import RuntimeProcess, key_entry, keys_secret, tenant_quota
from zerolayer.cluster.local import node_manifest

POOL = "zerolayer.io/e2e-pool"
PACE = {"kind": "synthetic", "tokens_per_second": 20, "output_tokens": 40}  # 40 tokens: 2 s a request
FLEET_RESOURCES = ("inferencefleets", "inferencefleets/status", "inferencefleets/scale", "nodes")


def fleet_doc(name: str, run: str, model: str, *, autoscaling: dict | None, replicas: int) -> dict:
    spec: dict[str, Any] = {
        "replicas": replicas, "nodeSelector": {POOL: run},
        "models": [{"name": model, "source": {"path": "/none"}}],
        "runtime": {"engine": "synthetic", "port": 18443, "gpus": 0, "drainSeconds": 5,
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}},
        "gossip": {"heartbeatSeconds": 2, "staleAfterSeconds": 10}}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": API, "kind": "InferenceFleet", "metadata": {"name": name, "labels": {E2E_LABEL: run}},
            "spec": spec}


def operator_requests(operator: OperatorProcess) -> dict[tuple[str, str], float]:
    """The operator's own API requests so far, by (verb, resource)."""
    text = operator.get(operator.metrics_port, "/metrics") or ""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("zerolayer_operator_api_requests_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["verb"].strip('"'), labels["resource"].strip('"'))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class RuntimeSupervisor:
    """One runtime process per live InferenceNode matching ``selector`` (the kubelet's part here)."""

    def __init__(self, cluster, selector: str, tenant_namespace: str, workdir: pathlib.Path) -> None:
        self.cluster, self.selector, self.tenant_namespace, self.workdir = cluster, selector, tenant_namespace, workdir
        self.config = workdir / "paced-synthetic.json"  # JSON is YAML: the runtime's --config reads it
        self.config.write_text(json.dumps({"engine": PACE}))
        self.runtimes: dict[str, RuntimeProcess] = {}
        self.serving_at: dict[str, float] = {}
        self.stopped: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="runtime-supervisor", daemon=True)

    def start(self) -> "RuntimeSupervisor":
        self._thread.start()
        return self

    def launch(self, name: str) -> RuntimeProcess:
        runtime = RuntimeProcess(self.cluster.kubeconfig, name, self.tenant_namespace, self.workdir,
                                 extra=["--config", str(self.config), "--in-cluster", "--tenant-sync-seconds", "2",
                                        "--log-level", "WARNING"], env=self.cluster.env()).start()
        with self._lock:
            self.runtimes[name] = runtime

        def serving() -> None:
            try:
                runtime.wait_serving(120)
                self.serving_at[name] = time.monotonic()
            except AssertionError:
                pass  # stopped before it served (scaled away) or failed: its log says which

        threading.Thread(target=serving, daemon=True).start()
        return runtime

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                items = self.cluster.kubectl_json("get", "inferencenodes", "-l", self.selector)["items"]
            except Exception:  # noqa: BLE001 - the API server busy for a moment: look again
                continue
            live = {x["metadata"]["name"] for x in items if not x["metadata"].get("deletionTimestamp")}
            for name in sorted(live - set(self.runtimes)):
                self.launch(name)
            for name in sorted(set(self.runtimes) - live):
                with self._lock:
                    runtime = self.runtimes.pop(name)
                self.stopped.append(name)
                threading.Thread(target=runtime.stop, daemon=True).start()  # SIGTERM: it drains

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            runtimes, self.runtimes = list(self.runtimes.values()), {}
        for runtime in runtimes:
            runtime.stop()


@dataclasses.dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    error: str = ""


class LoadClient:
    """SDK workers sending ``model`` requests; ``concurrency`` (settable) workers are active at a time.

    Every retry the SDK schedules is recorded (``retries``: error code, reason) and every request's end
    (``outcomes``): a request that raised is a lost one. Each worker has its own ``Client`` (one HTTP/2
    pool each: httpx's sync HTTP/2 connection is not safe to share between threads, encode/httpx#3566),
    all on one node map and retry budget and one session, so their load lands on the session's node."""

    def __init__(self, cluster, key: str, model: str, selector: str, workers: int = 16) -> None:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        from zerolayer.client import KubernetesNodeMap, RetryBudget

        api = k8s.CustomObjectsApi(k8s_config.new_client_from_config(config_file=cluster.kubeconfig))
        self.node_map = KubernetesNodeMap(api, label_selector=selector)
        self.budget = RetryBudget(ratio=0.5, burst=50)
        self.key, self.session = key, f"load-{selector.rsplit('=', 1)[-1]}"
        self.model = model
        self.concurrency = 0
        self.retries: list[tuple[str, str]] = []
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._clients: list[Any] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _event(self, event: Any) -> None:
        from zerolayer.client.events import RetryScheduled

        if isinstance(event, RetryScheduled):
            with self._lock:
                self.retries.append((event.error, event.reason))

    def client(self) -> Any:
        from zerolayer.client import Client

        return Client(api_key=self.key, nodes=self.node_map, on_event=self._event, deadline=None,
                      session=self.session, retry_budget=self.budget, timeout=60.0)

    def one(self, client: Any) -> Outcome:
        started = time.monotonic()
        try:
            client.messages.create(model=self.model, max_tokens=40, messages=[{"role": "user", "content": "scale me"}])
            outcome = Outcome(started, time.monotonic(), True)
        except Exception as exc:  # noqa: BLE001 - a lost request, reported by the test
            outcome = Outcome(started, time.monotonic(), False, f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def _worker(self, index: int) -> None:
        client = self.client()
        with self._lock:
            self._clients.append(client)
        while not self._stop.is_set():
            if index < self.concurrency:
                self.one(client)
            else:
                self._stop.wait(0.2)

    def close(self) -> None:
        self.concurrency = 0
        self._stop.set()
        for thread in self._threads:
            thread.join(70)
        for client in self._clients:  # each closes its pool and the shared node map (idempotent)
            client.close()


class FleetRig:
    """This run's objects: a pool of kwok Nodes, a tenant, an other runtime (serving another model: the
    one that refuses the fleet's model and records the demand while the fleet is at zero), the operator."""

    def __init__(self, cluster, run: str, workdir: pathlib.Path, pool: int = 3) -> None:
        self.cluster, self.run, self.workdir = cluster, run, workdir
        self.namespace, self.tenant_namespace = f"zl-e2e-fa-{run}", f"zl-e2e-fa-{run}-keys"
        self.tenant, self.key = f"fa-{run}", f"sk-fa-{run}"
        self.selector = f"{E2E_LABEL}={run}"
        self.pool = [f"zl-e2e-{run}-p{i}" for i in range(pool)]
        self.other = f"zl-e2e-{run}-other"
        self.operator = OperatorProcess(cluster, self.namespace, run, workdir)
        self.supervisor = RuntimeSupervisor(cluster, self.selector, self.tenant_namespace, workdir)

    def up(self) -> "FleetRig":
        for ns in (self.namespace, self.tenant_namespace):
            self.cluster.kubectl("create", "namespace", ns)
        nodes = []
        for name in [*self.pool, self.other]:
            doc = node_manifest(name)
            if name in self.pool:
                doc["metadata"]["labels"][POOL] = self.run
            nodes.append(doc)
        other = {"apiVersion": API, "kind": "InferenceNode", "metadata": {"name": self.other,
                                                                          "labels": {E2E_LABEL: self.run}},
                 "spec": {"nodeName": self.other, "models": [{"name": f"other-{self.run}", "source": {"path": "/none"}}],
                          "runtime": {"engine": "synthetic", "port": 18443, "gpus": 0},
                          "gossip": {"heartbeatSeconds": 2, "staleAfterSeconds": 10}}}
        quota = tenant_quota(self.tenant, self.run, self.tenant_namespace, requestsPerMinute=6000,
                             tokensPerMinute=1_000_000)
        docs = [*nodes, other, quota, keys_secret(self.tenant_namespace, {self.tenant: key_entry(self.tenant, [self.key])})]
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        self.operator.start()
        self.supervisor.start()
        return self

    def fleet(self, name: str) -> dict:
        out = self.cluster.kubectl("get", "inferencefleet", name, "-o", "json", "--ignore-not-found").stdout.strip()
        return json.loads(out) if out else {}

    def members(self, fleet: str) -> list[str]:
        items = self.cluster.kubectl_json("get", "inferencenodes", "-l", f"zerolayer.io/fleet={fleet}")["items"]
        return sorted(x["metadata"]["name"] for x in items if not x["metadata"].get("deletionTimestamp"))

    def serving(self, fleet: str) -> list[str]:
        return [n for n in self.members(fleet) if n in self.supervisor.serving_at]

    def fleet_requests(self) -> float:
        """The operator's API requests on fleets and Nodes plus its InferenceNode writes and lists:
        what the fleet reconciler and its autoscaler spend (InferenceNode reconciles are not counted)."""
        spent = operator_requests(self.operator)
        return sum(v for (verb, res), v in spent.items()
                   if res in FLEET_RESOURCES or (res == "inferencenodes" and verb in ("create", "delete", "list")))

    def all_requests(self) -> float:
        return sum(operator_requests(self.operator).values())

    def down(self) -> None:
        self.cluster.kubectl("delete", "inferencefleets", "-l", self.selector, "--wait=false", check=False)
        self.cluster.kubectl("delete", "inferencenodes", "-l", self.selector, "--wait=false", check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                self.cluster.kubectl_json("get", "inferencenodes", "-l", self.selector)["items"]
                or self.cluster.kubectl_json("get", "inferencefleets", "-l", self.selector)["items"]):
            time.sleep(1)
        for kind in ("inferencefleets", "inferencenodes"):
            for obj in self.cluster.kubectl_json("get", kind, "-l", self.selector)["items"]:
                self.cluster.kubectl("patch", kind[:-1], obj["metadata"]["name"], "--type=merge",
                                     "-p", '{"metadata": {"finalizers": null}}', check=False)
        self.supervisor.stop()
        self.operator.stop()
        self.cluster.kubectl("delete", "tenantquota", self.tenant, "--wait=false", check=False)
        self.cluster.kubectl("delete", "node", *self.pool, self.other, "--wait=false", check=False)
        for ns in (self.namespace, self.tenant_namespace):
            self.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
