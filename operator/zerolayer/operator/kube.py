"""The one module that calls the Kubernetes API.

Everything else in the operator receives and returns plain dicts. Requests go out through
:mod:`~zerolayer.operator.kubehttp` (aiohttp on the event loop; credentials from the kubeconfig or
the in-cluster service account); every failure leaves as a
:class:`~zerolayer.operator.errors.KubeError` (``NotFound``, ``Conflict`` or the base). What the
watches saw lives in :mod:`~zerolayer.operator.kubecache`; the operator's own watch in
:mod:`~zerolayer.operator.watchstream`.

Idempotency lives here too: :meth:`Kube.ensure` compares the wanted object with what the
watches last saw and writes only when they differ, with one server-side apply under the
field manager ``zerolayer-operator`` (create or update in one request, no read first).
Re-running a reconcile against a converged cluster therefore makes no request at all.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import logging
import socket
import time
from typing import Any, AsyncIterator, Callable, Mapping

from zerolayer.operator import manifests, watchstream
from zerolayer.operator.errors import Conflict, KubeError, NotFound, NotOwned
from zerolayer.operator.kubecache import Key, ObjectCache, comparable, is_subset
from zerolayer.operator.kubehttp import (  # noqa: F401 - re-exported: callers know them as kube.*
    APPLY_PATCH, FIELD_MANAGER, KINDS, ApiTransport, Credentials, path_of, resource_of)

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
EVENT_NAMESPACE_FOR_CLUSTER_OBJECTS = "default"  # where kubectl looks for events of cluster-scoped objects


@dataclasses.dataclass(frozen=True)
class SecretCheck:
    """What the operator may know about an API-key Secret: never its values."""

    found: bool
    has_key: bool = False
    key_count: int = 0
    # SHA-256 digests of the keys (what the runtimes are given instead of the Secret).
    key_hashes: tuple[str, ...] = ()
    # The Secret's labels (its opt-in to being read for a tenant, validation.KEY_SECRET_LABEL).
    labels: tuple[tuple[str, str], ...] = ()


def event_body(involved: Mapping[str, Any], reason: str, message: str, *, warning: bool, instance: str) -> dict:
    """A core/v1 Event about ``involved`` from the operator (``instance``: which replica wrote it)."""
    meta = involved["metadata"]
    namespace = meta.get("namespace") or EVENT_NAMESPACE_FOR_CLUSTER_OBJECTS
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                           "name": meta["name"], "uid": meta.get("uid"),
                           **({"namespace": meta["namespace"]} if meta.get("namespace") else {})},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "zerolayer-operator"},
        "reportingComponent": "zerolayer-operator",
        "reportingInstance": instance[:128],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class Kube:
    """Async access to the objects the operator manages: HTTP through an :class:`ApiTransport`, reads
    and write decisions through the watch-fed :class:`~zerolayer.operator.kubecache.ObjectCache`.

    ``on_request(verb, resource, code)`` is called once per API request (metrics).
    """

    def __init__(self, credentials: Credentials, *, on_request: Callable[[str, str, int], None] | None = None,
                 timeout: float = 30.0, identity: str | None = None, crd_cache_seconds: float = 30.0,
                 cache: ObjectCache | None = None):
        self.transport = ApiTransport(credentials, on_request=on_request, timeout=timeout)
        self.cache = cache or ObjectCache()
        self._crd_cache: dict[str, tuple[float, bool]] = {}
        self._crd_cache_seconds = crd_cache_seconds
        self.identity = identity or socket.gethostname()

    async def close(self) -> None:
        await self.transport.close()

    # ----------------------------------------------------------------- transport
    async def request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                      query: Mapping[str, str] | None = None) -> dict:
        """One API request; returns the decoded JSON body or raises a KubeError."""
        return (await self.send(method, path, body=body, content_type=content_type, query=query))[1]

    async def send(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                   query: Mapping[str, str] | None = None) -> tuple[int, dict]:
        """One API request; (HTTP status, decoded JSON body) or a KubeError (:meth:`ApiTransport.send`)."""
        return await self.transport.send(method, path, body=body, content_type=content_type, query=query)

    def watch_once(self, path: str, plural: str, version: str | None, timeout_seconds: int,
                   selector: Mapping[str, str] | None = None) -> AsyncIterator[tuple[str, dict]]:
        """One watch request from ``version``: its events until the server ends it."""
        return self.transport.watch_once(path, plural, version, timeout_seconds, selector)

    def watch_stream(self, api_version: str, kind: str, namespace: str | None = None, *,
                     field_selector: str | None = None, timeout_seconds: int = 1800,
                     retry_seconds: float = 1.0) -> AsyncIterator[tuple[str, dict]]:
        """Follow the objects of a kind for as long as the caller iterates (:func:`watchstream.follow`)."""
        return watchstream.follow(self.request, self.watch_once, api_version, kind, namespace,
                                  field_selector=field_selector, timeout_seconds=timeout_seconds,
                                  retry_seconds=retry_seconds)

    # ----------------------------------------------------------------- watch-fed cache (ObjectCache)
    def watch(self, api_version: str, kind: str, namespace: str | None = None) -> None:
        self.cache.watch(api_version, kind, namespace)

    def remember(self, api_version: str, kind: str) -> None:
        self.cache.remember(api_version, kind)

    def observe(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        self.cache.observe(event_type, obj)

    def seen_all(self, api_version: str, kind: str) -> list[dict]:
        return self.cache.seen_all(api_version, kind)

    def peek(self, key: Key) -> dict | None:
        return self.cache.peek(key)

    def freshest(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.cache.freshest(obj)

    def drifted(self, obj: Mapping[str, Any]) -> bool:
        return self.cache.drifted(obj)

    def forget(self) -> None:
        """Drop every cached object and CRD answer, so the next reads go to the API server (the full resync)."""
        self.cache.clear()
        self._crd_cache.clear()

    # ----------------------------------------------------------------- objects
    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None, *,
                  cached: bool = False) -> dict | None:
        """The object, or None when it does not exist.

        ``cached``: answer from the watch-fed cache when the object is there (a converged
        reconcile then costs no request); a miss still asks the API server, so absence is
        never assumed from a watch that has not caught up.
        """
        key = (api_version, kind, namespace, name)
        if cached and (obj := self.peek(key)) is not None:
            return obj
        try:
            obj = await self.request("GET", path_of(api_version, kind, namespace, name))
        except NotFound:
            return None
        self.cache.keep(key, obj)
        return obj

    async def list(self, api_version: str, kind: str, namespace: str | None = None, *,
                   label_selector: str | None = None) -> list[dict]:
        query = {"labelSelector": label_selector} if label_selector else None
        if namespace is None and KINDS[(api_version, kind)][2]:
            prefix, plural, _ = KINDS[(api_version, kind)]
            result = await self.request("GET", f"{prefix}/{plural}", query=query)
        else:
            result = await self.request("GET", path_of(api_version, kind, namespace), query=query)
        return result.get("items", [])

    async def ensure(self, desired: Mapping[str, Any]) -> tuple[str, dict]:
        """Make the object match ``desired``; returns (``"created"``, ``"updated"`` or
        ``"unchanged"``, the object as the server has it now).

        The watch-fed cache decides whether to write: an object the watches saw and that already
        says everything ``desired`` says costs no request. Otherwise one server-side apply: if
        the cache held the object, forced (the fields are ours; someone edited them by hand); if
        it did not (not created yet, or the watches have not caught up after a start), not
        forced, so a conflict with another field manager or another controller's object ends
        in a read and the usual ownership check instead of a takeover. An apply that finds the
        object already there and changes nothing answers 200 and reports ``"unchanged"``.
        """
        api_version, kind = desired["apiVersion"], desired["kind"]
        meta = desired["metadata"]
        name, namespace = meta["name"], meta.get("namespace")
        key = (api_version, kind, namespace, name)
        owner_uid = next((r.get("uid") for r in meta.get("ownerReferences") or () if r.get("controller")), None)
        want = comparable(desired)
        self.cache.desired[key] = want
        current = self.peek(key)
        if current is None:
            try:
                code, obj = await self._apply(desired, force=False)
                return ("created" if code == 201 else "unchanged"), obj
            except NotFound:
                # RBAC kinds refuse an apply that creates when the caller may not escalate (the
                # API server answers 404 instead of creating): create them the classic way.
                obj = await self.request("POST", path_of(api_version, kind, namespace), body=desired)
                self.cache.keep(key, obj)
                return "created", obj
            except KubeError as exc:
                if exc.status not in (409, 422):
                    raise
                # A field another manager set differently (409), or another controller's object
                # (422: two controller references): read it and decide as for a cached object.
                current = await self.get(api_version, kind, name, namespace)
                if current is None:
                    raise
        other = manifests.foreign_controller(current, owner_uid)
        if other is not None:
            raise NotOwned(f"{kind} {name} is controlled by {other}; not adopting it", other)
        if current.get("metadata", {}).get("deletionTimestamp"):
            self.cache.drop(key)  # read it fresh next time
            raise KubeError(f"{kind} {name} is being deleted; will recreate it once it is gone", status=409,
                            reason="Conflict")
        if is_subset(want, current):
            return "unchanged", current
        code, obj = await self._apply(desired, force=True)
        return ("created" if code == 201 else "updated"), obj

    async def apply(self, desired: Mapping[str, Any], *, force: bool = True) -> dict:
        """Server-side apply ``desired`` as the operator's field manager; returns the object."""
        return (await self._apply(desired, force=force))[1]

    async def _apply(self, desired: Mapping[str, Any], *, force: bool) -> tuple[int, dict]:
        """One server-side apply of ``desired`` (201: it created the object)."""
        meta = desired["metadata"]
        body = {k: v for k, v in desired.items() if k != "status"}
        key = (desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
        code, obj = await self.send("PATCH", path_of(*key[:2], key[2], key[3]), body=body,
                                    content_type=APPLY_PATCH, query={"force": "true"} if force else None)
        self.cache.keep(key, obj)
        return code, obj

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete (dependents in the background); False when it was already gone."""
        try:
            await self.request("DELETE", path_of(api_version, kind, namespace, name),
                               body={"kind": "DeleteOptions", "apiVersion": "v1",
                                     "propagationPolicy": "Background"})
            return True
        except NotFound:
            return False
        finally:
            self.cache.drop((api_version, kind, namespace, name))
            self.cache.desired.pop((api_version, kind, namespace, name), None)

    async def patch_metadata(self, api_version: str, kind: str, name: str, *,
                             labels: Mapping[str, str | None] | None = None,
                             annotations: Mapping[str, str | None] | None = None,
                             namespace: str | None = None) -> None:
        """Merge labels and annotations into an object's metadata; a None value removes one."""
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        key = (api_version, kind, namespace, name)
        try:
            patched = await self.request("PATCH", path_of(api_version, kind, namespace, name),
                                         body={"metadata": meta}, content_type=MERGE_PATCH)
        except NotFound:
            self.cache.drop(key)
            raise
        self.cache.keep(key, patched)

    async def patch_status(self, api_version: str, kind: str, name: str, status: Mapping[str, Any],
                           namespace: str | None = None) -> None:
        """Merge ``status`` into the status subresource (fields not named stay as they are)."""
        key = (api_version, kind, namespace, name)
        try:
            patched = await self.request("PATCH", path_of(api_version, kind, namespace, name, "status"),
                                         body={"status": dict(status)}, content_type=MERGE_PATCH)
        except NotFound:
            # Gone: the cached copy (which an in-flight write's answer may have put back after the
            # watch reported the deletion) must not send the next trigger here again.
            self.cache.drop(key)
            raise
        self.cache.keep(key, patched)

    def note_crd(self, name: str, exists: bool) -> bool:
        """Feed a CRD watch event; True when it changes what :meth:`crd_exists` last answered
        (the CRD was installed or removed since), False when it confirms it or nothing was known."""
        known = self._crd_cache.get(name)
        self._crd_cache[name] = (time.monotonic(), exists)
        return known is not None and known[1] != exists

    async def crd_exists(self, name: str) -> bool:
        """Whether a CustomResourceDefinition is installed (cached for ``crd_cache_seconds``, so
        1,000 TenantQuotas do not mean 1,000 lookups; installing Cilium is noticed within that)."""
        cached = self._crd_cache.get(name)
        if cached and time.monotonic() - cached[0] < self._crd_cache_seconds:
            return cached[1]
        exists = await self.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name) is not None
        self._crd_cache[name] = (time.monotonic(), exists)
        return exists

    async def check_secret(self, namespace: str, name: str, key: str) -> SecretCheck:
        """Whether the Secret exists, holds ``key``, how many API keys (non-empty lines) it holds,
        and their SHA-256 digests.

        The decoded value lives only inside this function; it is never returned or logged.
        """
        secret = await self.get("v1", "Secret", name, namespace)
        if secret is None:
            return SecretCheck(found=False)
        labels = tuple(sorted(((secret.get("metadata") or {}).get("labels") or {}).items()))
        data = (secret.get("data") or {}).get(key)
        if data is None:
            return SecretCheck(found=True, has_key=False, labels=labels)
        try:
            text = base64.b64decode(data).decode("utf-8")
        except ValueError:  # binascii.Error and UnicodeDecodeError: no usable keys
            return SecretCheck(found=True, has_key=True, key_count=0, labels=labels)
        hashes = tuple(manifests.key_hashes(text))
        return SecretCheck(found=True, has_key=True, key_count=len(hashes), key_hashes=hashes, labels=labels)

    async def read_published_keys(self, namespace: str) -> dict[str, str]:
        """The raw entries (TenantQuota name -> base64) of the fleet's key-hash Secret; {} before the first."""
        secret = await self.get("v1", "Secret", manifests.TENANT_KEYS_SECRET, namespace)
        return dict((secret or {}).get("data") or {})

    async def publish_keys(self, namespace: str, entries: Mapping[str, str | None]) -> None:
        """Merge entries into the fleet's key-hash Secret (None removes one), creating it if needed.

        A JSON merge patch of ``data`` touches only the named entries, so reconciles of different
        TenantQuotas never overwrite each other's."""
        path = path_of("v1", "Secret", namespace, manifests.TENANT_KEYS_SECRET)
        try:
            await self.request("PATCH", path, body={"data": dict(entries)}, content_type=MERGE_PATCH)
            return
        except NotFound:
            pass
        secret = manifests.build_tenant_keys_secret(namespace)
        secret["data"] = {k: v for k, v in entries.items() if v is not None}
        try:
            await self.request("POST", path_of("v1", "Secret", namespace), body=secret)
        except Conflict:  # created meanwhile by a concurrent reconcile: merge into it
            await self.request("PATCH", path, body={"data": dict(entries)}, content_type=MERGE_PATCH)

    async def event(self, involved: Mapping[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
        """Record a Kubernetes Event about ``involved``.

        Events are best effort in Kubernetes itself: a failure to record one is logged and
        does not fail the reconciliation that it describes.
        """
        meta = involved["metadata"]
        body = event_body(involved, reason, message, warning=warning, instance=self.identity)
        namespace = body["metadata"]["namespace"]
        try:
            await self.request("POST", path_of("v1", "Event", namespace), body=body)
        except KubeError as exc:
            log.warning("could not record event %s on %s/%s: %s", reason, involved.get("kind"), meta["name"], exc)
