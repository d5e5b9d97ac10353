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
import hashlib
import json

from zerolayer.runtime.incluster import ClusterReadError


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
        from zerolayer.runtime.incluster import published_entries  # today's interface only

        self.calls["tenant_keys"] += 1
        data = {}
        for q in self.quotas:
            secret = q["spec"]["apiKeySecretRef"]["name"]
            if secret in self.forbidden or secret not in self.keys:
                continue  # the operator could not read it: nothing published for that quota
            data[q["metadata"]["name"]] = encoded({
                "tenant": q["spec"]["tenant"], "created": q["metadata"]["creationTimestamp"],
                "hashes": sorted(sha(k) for k in self.keys[secret] if k.strip())})
        return published_entries({"data": data})

    def requests(self) -> int:
        return sum(self.calls.values())


def encoded(entry: dict) -> str:
    return base64.b64encode(json.dumps(entry).encode()).decode()
