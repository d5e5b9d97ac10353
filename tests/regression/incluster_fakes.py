"""A reader double for the runtime's in-cluster tenant sync, for the regression tier.

It speaks both interfaces the runtime has had: the one of 410a271 (``secret(namespace,
name)``, one read per tenant's Secret) and today's (``tenant_keys()``, the one Secret of
key hashes the operator publishes, see ``zerolayer.operator.manifests.build_tenant_key_entry``).
What it publishes is what the operator publishes: tenants whose Secret it could read. Every
call is counted, so tests can assert how many API requests one sync costs.
"""

from __future__ import annotations

import base64
import collections
import copy
import hashlib
import json
import threading

from zerolayer.runtime.node.incluster import ClusterReadError


def quota(name: str, tenant: str | None = None, secret: str | None = None, created: str = "2026-01-01T00:00:00Z",
          **spec):  # type: ignore[no-untyped-def]
    base = {"tenant": tenant or name, "apiKeySecretRef": {"name": secret or f"{name}-keys", "namespace": "team"},
            "namespaces": ["team"], "allowedPriorities": ["high", "normal", "low"],
            "tokensPerMinute": 100000, "requestsPerMinute": 1000}
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": {**base, **spec}}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Reader:
    def __init__(self, quotas, keys):  # type: ignore[no-untyped-def]
        self.quotas = list(quotas)
        self.keys = dict(keys)  # Secret name -> list of keys
        self.forbidden: set[str] = set()  # Secret names the runtime's account may not read (403)
        self.calls: collections.Counter[str] = collections.Counter()

    def tenant_quotas(self):  # type: ignore[no-untyped-def]
        self.calls["tenant_quotas"] += 1
        return [dict(q) for q in self.quotas]

    def secret(self, namespace, name):  # type: ignore[no-untyped-def]
        self.calls["secret"] += 1
        if name in self.forbidden:
            raise ClusterReadError(f"read Secret {namespace}/{name}: HTTP 403 Forbidden")
        if name not in self.keys:
            return None
        text = "\n".join(self.keys[name])
        return {"data": {"api-keys": base64.b64encode(text.encode()).decode()}}

    def tenant_keys(self, namespace=None):  # type: ignore[no-untyped-def]
        from zerolayer.runtime.node.incluster import published_entries  # today's interface only

        self.calls["tenant_keys"] += 1
        return published_entries({"data": self._published_data()})

    # The watch interface of KubeReader (issue 16): the fake's state, delivered as watch events.
    def watch_tenant_quotas(self, on_change, *, retry_s=2.0):  # type: ignore[no-untyped-def]
        return PolledWatch(lambda: {q["metadata"]["name"]: q for q in self.tenant_quotas()}, on_change)

    def watch_tenant_keys(self, namespace, on_change, *, retry_s=2.0):  # type: ignore[no-untyped-def]
        return PolledWatch(lambda: {f"{namespace}/zl-tenant-keys": {"data": self._published_data()}}, on_change)

    def watch_inference_node(self, node, on_change, *, retry_s=2.0):  # type: ignore[no-untyped-def]
        return PolledWatch(lambda: {node: self.inference_node(node)}, on_change)

    def claim_api(self):  # type: ignore[no-untyped-def]
        return ClaimApi(self)

    def _published_data(self):  # type: ignore[no-untyped-def]
        data = {}
        for q in self.quotas:
            secret = q["spec"]["apiKeySecretRef"]["name"]
            if secret in self.forbidden or secret not in self.keys:
                continue  # the operator could not read it: nothing published for that quota
            data[q["metadata"]["name"]] = encoded({
                "tenant": q["spec"]["tenant"], "created": q["metadata"]["creationTimestamp"],
                "hashes": sorted(sha(k) for k in self.keys[secret] if k.strip())})
        return data

    def requests(self) -> int:
        return sum(self.calls.values())


def encoded(entry: dict) -> str:
    return base64.b64encode(json.dumps(entry).encode()).decode()


class PolledWatch:
    """Stands in for ``zerolayer.kubewatch.WatchLoop`` over a fake's state: re-reads it in a thread and
    calls ``on_change`` when it differs (what a watch event does); a read that raises is a failed watch
    request, counted in ``counters.errors``."""

    def __init__(self, read, on_change, period_s: float = 0.01):  # type: ignore[no-untyped-def]
        from zerolayer.kubewatch import WatchCounters

        self.read, self.on_change, self.period_s = read, on_change, period_s
        self.objects: dict = {}
        self.started = threading.Event()
        self.counters = WatchCounters()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):  # type: ignore[no-untyped-def]
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            try:
                objects = copy.deepcopy(self.read())
            except Exception:  # noqa: BLE001 - any failure of the fake's read is a failed request
                self.counters.errors += 1
                self._stop.wait(self.period_s)
                continue
            if objects != last:
                last, self.objects = objects, objects
                self.started.set()
                self.on_change()
            self._stop.wait(self.period_s)


class ClaimApi:
    """The fleet quota claims' API over a Reader's TenantQuotas (merge-patches ``status``)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def watch(self, on_change, *, retry_s=2.0):  # type: ignore[no-untyped-def]
        return PolledWatch(lambda: {q["metadata"]["name"]: q for q in self.reader.quotas}, on_change)

    def get(self, name):  # type: ignore[no-untyped-def]
        return copy.deepcopy(next(q for q in self.reader.quotas if q["metadata"]["name"] == name))

    def patch_status(self, name, patch):  # type: ignore[no-untyped-def]
        quota = next(q for q in self.reader.quotas if q["metadata"]["name"] == name)
        nodes = quota.setdefault("status", {}).setdefault("fleetQuota", {}).setdefault("nodes", {})
        nodes.update(copy.deepcopy(patch["status"]["fleetQuota"]["nodes"]))
        return copy.deepcopy(quota)
