"""An in-memory stand-in for :class:`zerolayer.operator.kube.Kube` (the operator's own API wrapper).

Unit tests of the reconciler mock at this level, not at HTTP: it keeps objects in a dict,
applies merge patches, and records every write, so tests can assert "a second reconcile
writes nothing". It is a test double for a cluster, named as such; the e2e tier runs the
real wrapper against a real API server.
"""

from __future__ import annotations

import copy
import itertools

from zerolayer.operator.kube import SecretCheck, is_subset
from zerolayer.operator.kubecache import comparable as _comparable
from zerolayer.operator.errors import NotOwned
from zerolayer.operator.manifests import TENANT_KEYS_SECRET, foreign_controller, key_hashes, read_tenant_key_entry

_uid = itertools.count(1)


def merge(target: dict, patch: dict) -> dict:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


class FakeKube:
    def __init__(self):
        self.objects: dict[tuple, dict] = {}
        self.writes: list[tuple] = []
        self.events: list[tuple] = []
        self.crds: set[str] = set()
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.secret_labels: dict[tuple[str, str], dict[str, str]] = {}  # metadata.labels of those Secrets
        self.reads: list[tuple] = []  # (kind, name, cached) of every get()

    # helpers for tests
    def put(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.setdefault("uid", f"uid-{next(_uid)}")
        meta.setdefault("generation", 1)
        self.objects[(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])] = obj
        return obj

    def find(self, api_version, kind, name, namespace=None):
        return self.objects.get((api_version, kind, namespace, name))

    def kinds(self, kind):
        return sorted(k[3] for k in self.objects if k[1] == kind)

    # the Kube interface
    def peek(self, key):
        """The fake's cache is the truth (the real one is fed by watches)."""
        obj = self.objects.get(key)
        return copy.deepcopy(obj) if obj else None

    async def get(self, api_version, kind, name, namespace=None, *, cached=False):
        self.reads.append((kind, name, cached))
        obj = self.find(api_version, kind, name, namespace)
        return copy.deepcopy(obj) if obj else None

    def freshest(self, obj):
        return obj  # tests hand over the body they mean

    async def list(self, api_version, kind, namespace=None, *, label_selector=None):
        wanted = dict(part.split("=", 1) for part in label_selector.split(",")) if label_selector else {}
        return [copy.deepcopy(obj) for (av, k, ns, _), obj in sorted(self.objects.items())
                if av == api_version and k == kind and (namespace is None or ns == namespace)
                and wanted.items() <= (obj["metadata"].get("labels") or {}).items()]

    async def ensure(self, desired):
        meta = desired["metadata"]
        key = (desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
        current = self.objects.get(key)
        if current is None:
            self.writes.append(("create",) + key)
            return "created", copy.deepcopy(self.put(desired))
        owner_uid = next((r.get("uid") for r in meta.get("ownerReferences") or () if r.get("controller")), None)
        other = foreign_controller(current, owner_uid)
        if other is not None:
            raise NotOwned(f"{desired['kind']} {meta['name']} is controlled by {other}; not adopting it", other)
        want = _comparable(desired)
        if is_subset(want, current):
            return "unchanged", copy.deepcopy(current)
        self.writes.append(("patch",) + key)
        return "updated", copy.deepcopy(merge(current, want))

    async def delete(self, api_version, kind, name, namespace=None):
        key = (api_version, kind, namespace, name)
        if key in self.objects:
            del self.objects[key]
            self.writes.append(("delete",) + key)
            return True
        return False

    async def patch_metadata(self, api_version, kind, name, *, labels=None, annotations=None, namespace=None):
        obj = self.objects[(api_version, kind, namespace, name)]
        if labels:
            merge(obj["metadata"].setdefault("labels", {}), dict(labels))
        if annotations:
            merge(obj["metadata"].setdefault("annotations", {}), dict(annotations))
        self.writes.append(("metadata", api_version, kind, namespace, name))

    async def patch_status(self, api_version, kind, name, status, namespace=None):
        obj = self.objects[(api_version, kind, namespace, name)]
        merge(obj.setdefault("status", {}), copy.deepcopy(dict(status)))
        self.writes.append(("status", api_version, kind, namespace, name))

    async def crd_exists(self, name):
        return name in self.crds

    async def check_secret(self, namespace, name, key):
        data = self.secrets.get((namespace, name))
        if data is None:
            return SecretCheck(found=False)
        labels = tuple(sorted(self.secret_labels.get((namespace, name), {}).items()))
        if key not in data:
            return SecretCheck(found=True, labels=labels)
        hashes = tuple(key_hashes(data[key]))
        return SecretCheck(found=True, has_key=True, key_count=len(hashes), key_hashes=hashes, labels=labels)

    async def read_published_keys(self, namespace):
        secret = self.find("v1", "Secret", TENANT_KEYS_SECRET, namespace)
        return dict((secret or {}).get("data") or {})

    async def publish_keys(self, namespace, entries):
        secret = self.find("v1", "Secret", TENANT_KEYS_SECRET, namespace)
        if secret is None:
            secret = self.put({"apiVersion": "v1", "kind": "Secret",
                               "metadata": {"name": TENANT_KEYS_SECRET, "namespace": namespace}, "data": {}})
        merge(secret.setdefault("data", {}), dict(entries))
        self.writes.append(("publish", "v1", "Secret", namespace, TENANT_KEYS_SECRET))

    def published_tenant_keys(self, namespace):
        """For tests: the published entries, decoded."""
        secret = self.find("v1", "Secret", TENANT_KEYS_SECRET, namespace) or {}
        return {name: read_tenant_key_entry(raw) for name, raw in (secret.get("data") or {}).items()}

    async def event(self, involved, reason, message, *, warning=False):
        self.events.append((involved["kind"], involved["metadata"]["name"], reason, message, warning))
