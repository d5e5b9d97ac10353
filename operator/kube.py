"""The one module that calls the Kubernetes API.

Everything else in the operator receives and returns plain dicts. Requests go out through
aiohttp on the event loop (nothing blocks it); credentials come from the kubeconfig or
the in-cluster service account, loaded once with the ``kubernetes`` package's loaders.
Errors are converted here: every failure leaves this module as a
:class:`~zerolayer.operator.errors.KubeError` (``NotFound``, ``Conflict`` or the base).

Idempotency lives here too: :meth:`Kube.ensure` compares the wanted object with what the
watches last saw and writes only when they differ, with one server-side apply under the
field manager ``zerolayer-operator`` (create or update in one request, no read first).
Re-running a reconcile against a converged cluster therefore makes no request at all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import socket
import ssl
import time
from typing import Any, AsyncIterator, Callable, Mapping

import aiohttp
import kubernetes.utils
from kubernetes import client as k8s_client

from zerolayer import kubeaccess
from zerolayer.operator import manifests
from zerolayer.operator.errors import Conflict, KubeError, NotFound, NotOwned

log = logging.getLogger(__name__)

# apiVersion, kind -> (URL prefix, plural, namespaced). Only the kinds the operator touches.
KINDS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "Node"): ("/api/v1", "nodes", False),
    ("v1", "Secret"): ("/api/v1", "secrets", True),
    ("v1", "PersistentVolumeClaim"): ("/api/v1", "persistentvolumeclaims", True),
    ("v1", "Pod"): ("/api/v1", "pods", True),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts", True),
    ("v1", "Service"): ("/api/v1", "services", True),
    ("v1", "Event"): ("/api/v1", "events", True),
    ("coordination.k8s.io/v1", "Lease"): ("/apis/coordination.k8s.io/v1", "leases", True),
    ("apps/v1", "DaemonSet"): ("/apis/apps/v1", "daemonsets", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"):
        ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    ("rbac.authorization.k8s.io/v1", "Role"): ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    ("cilium.io/v2", "CiliumNetworkPolicy"): ("/apis/cilium.io/v2", "ciliumnetworkpolicies", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    ("zerolayer.io/v1alpha1", "InferenceNode"): ("/apis/zerolayer.io/v1alpha1", "inferencenodes", False),
    ("zerolayer.io/v1alpha1", "TenantQuota"): ("/apis/zerolayer.io/v1alpha1", "tenantquotas", False),
}

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: server-side apply takes a JSON body
FIELD_MANAGER = "zerolayer-operator"
EVENT_NAMESPACE_FOR_CLUSTER_OBJECTS = "default"  # where kubectl looks for events of cluster-scoped objects


@dataclasses.dataclass(frozen=True)
class SecretCheck:
    """What the operator may know about an API-key Secret: never its values."""

    found: bool
    has_key: bool = False
    key_count: int = 0
    # SHA-256 digests of the keys (what the runtimes are given instead of the Secret).
    key_hashes: tuple[str, ...] = ()


def path_of(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
            subresource: str | None = None) -> str:
    """The REST path of an object (or of its collection when ``name`` is None)."""
    try:
        prefix, plural, namespaced = KINDS[(api_version, kind)]
    except KeyError:
        raise KubeError(f"the operator does not manage {kind} ({api_version})") from None
    if namespaced and not namespace:
        raise KubeError(f"{kind} {name or ''} needs a namespace")
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def resource_of(path: str) -> str:
    """The resource a REST path addresses (``daemonsets``, ``inferencenodes/status``...), for metrics."""
    parts = [p for p in path.split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(parts) >= 3 and parts[0] == "namespaces":
        parts = parts[2:]
    return "/".join(parts[:1] + parts[2:3]) or "unknown"


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, str) and isinstance(have, str):
        # The API server canonicalises quantities ("0.5" is stored as "500m").
        try:
            return kubernetes.utils.parse_quantity(want) == kubernetes.utils.parse_quantity(have)
        except (ValueError, ArithmeticError):
            return False
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Whether ``have`` already says everything ``want`` says.

    Dicts: every key of ``want`` present with a matching value (extra keys in ``have`` are
    server defaults and do not count); an empty list or dict in ``want`` also matches an
    absent key, since the server omits empty fields (``initContainers: []`` reads back as
    nothing). Lists: same length, matching element by element.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(v, have[k]) if k in have else v in ([], {}) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return _same_scalar(want, have)


def _comparable(manifest: Mapping[str, Any]) -> dict:
    """The parts of a desired manifest the server keeps as given."""
    out = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = manifest.get("metadata", {})
    out["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    return out


class Credentials:
    """Server URL, TLS context and a bearer-token source from a kubeconfig or the pod's account."""

    def __init__(self, configuration: k8s_client.Configuration):
        self.server = configuration.host.rstrip("/")
        self._configuration = configuration
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert) if configuration.verify_ssl \
            else ssl._create_unverified_context()  # noqa: S323 - only when the kubeconfig says insecure-skip-tls-verify
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
        self.ssl = context

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> "Credentials":
        """Kubeconfig (``kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``), else in-cluster."""
        try:
            return cls(kubeaccess.load_configuration(kubeconfig))
        except kubeaccess.KubeConfigError as exc:
            raise KubeError(f"cannot load Kubernetes credentials: {exc}") from exc

    def connection_fields(self) -> dict[str, Any]:
        """The same credentials as keyword arguments of ``kopf.ConnectionInfo`` (for kopf's
        own watches), so kopf and our client always talk to the same server as the same user."""
        c = self._configuration
        header = self.headers().get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return {"server": self.server, "ca_path": c.ssl_ca_cert, "insecure": not c.verify_ssl,
                "certificate_path": c.cert_file, "private_key_path": c.key_file,
                "scheme": scheme or None, "token": token or None}

    def headers(self) -> dict[str, str]:
        # get_api_key_with_prefix runs the refresh hook, so rotated in-cluster tokens are picked up.
        token = self._configuration.get_api_key_with_prefix("BearerToken") or \
            self._configuration.get_api_key_with_prefix("authorization")
        return {"Authorization": token} if token else {}


class Kube:
    """Async access to the objects the operator manages.

    ``on_request(verb, resource, code)`` is called once per API request (metrics).
    """

    def __init__(self, credentials: Credentials, *, on_request: Callable[[str, str, int], None] | None = None,
                 timeout: float = 30.0, identity: str | None = None, crd_cache_seconds: float = 30.0):
        self._credentials = credentials
        self._on_request = on_request or (lambda verb, resource, code: None)
        # Per socket operation, not in total: a request waiting for a free connection of the pool
        # (1,000 TenantQuotas reconciled at once share 32) is backpressure, not a dead API server.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._crd_cache: dict[str, tuple[float, bool]] = {}
        # Objects seen through watches (see observe()); only kinds and namespaces in
        # _watched are served from here, because only those learn about deletions.
        self._seen: dict[tuple[str, str, str | None, str], tuple[float, dict]] = {}
        # A watch filtered by label stops telling us about an object whose label someone
        # removed; entries are re-read after this long so even that drift is bounded.
        self.cache_seconds = 300.0
        self._watched: set[tuple[str, str, str | None]] = set()
        # Kinds no watch follows whose reads and writes are still kept for cache_seconds, for
        # callers that know when a cached copy is good enough (see remember()).
        self._remembered: set[tuple[str, str]] = set()
        # What ensure() last wanted of each object (its comparable part), for drifted().
        self._desired: dict[tuple[str, str, str | None, str], dict] = {}
        self._crd_cache_seconds = crd_cache_seconds
        self.identity = identity or socket.gethostname()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._credentials.ssl, limit=32), timeout=self._timeout)
        return self._session

    # ----------------------------------------------------------------- transport
    async def request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                      query: Mapping[str, str] | None = None) -> dict:
        """One API request; returns the decoded JSON body or raises a KubeError."""
        return (await self.send(method, path, body=body, content_type=content_type, query=query))[1]

    async def send(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                   query: Mapping[str, str] | None = None) -> tuple[int, dict]:
        """One API request; returns (HTTP status, decoded JSON body) or raises a KubeError.

        Writes carry ``fieldManager=zerolayer-operator``, so ``managedFields`` name the operator."""
        if method in ("POST", "PATCH", "PUT"):
            query = {"fieldManager": FIELD_MANAGER, **(query or {})}
        verb = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        if method == "PATCH" and content_type == APPLY_PATCH:
            verb = "apply"
        resource = resource_of(path)
        headers = {"Accept": "application/json", **self._credentials.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        try:
            async with self._http().request(method, self._credentials.server + path, data=data, headers=headers,
                                            params=dict(query or {})) as response:
                text = await response.text()
                code = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._on_request(verb, resource, 0)
            raise KubeError(f"{method} {path}: no answer from the API server ({exc.__class__.__name__}: {exc})") \
                from exc
        self._on_request(verb, resource, code)
        if 200 <= code < 300:
            return code, (json.loads(text) if text else {})
        reason, message = "", text[:500]
        try:
            status = json.loads(text)
            reason, message = status.get("reason", ""), status.get("message", message)
        except ValueError:
            pass
        error = NotFound if code == 404 else Conflict if code == 409 else KubeError
        raise error(f"{method} {path}: {code} {reason}: {message}", status=code, reason=reason)

    # ----------------------------------------------------------------- watch-fed cache
    def watch(self, api_version: str, kind: str, namespace: str | None = None) -> None:
        """Declare that a watch feeds :meth:`observe` with every event of this kind (in this
        namespace, or cluster-wide for None), so reads of it may be served from what it saw."""
        self._watched.add((api_version, kind, namespace))

    def remember(self, api_version: str, kind: str) -> None:
        """Keep what our own reads and writes return for objects of this kind (no watch follows
        them): ``get(cached=True)`` may then answer from that copy for ``cache_seconds``, so
        callers ask for it only when they know the object cannot have changed in a way that
        matters to them (Reconciler: a Node while its runtime DaemonSet is scheduled there)."""
        self._remembered.add((api_version, kind))

    def observe(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """Feed one watch event. Deletions drop the object; otherwise the newer version is kept."""
        meta = obj.get("metadata") or {}
        key = (obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace"), meta.get("name", ""))
        if event_type == "DELETED":
            self._seen.pop(key, None)
        else:
            self._remember(key, obj)

    def _remember(self, key: tuple, obj: Mapping[str, Any]) -> None:
        if not self._is_kept(key):
            return
        old = self._seen.get(key, (0.0, None))[1]
        if old is not None:
            new_rv, old_rv = obj.get("metadata", {}).get("resourceVersion", ""), \
                old.get("metadata", {}).get("resourceVersion", "")
            # resourceVersions are opaque by contract but etcd revisions in practice; an event
            # that arrives after our own write's answer must not roll the cache back.
            if new_rv.isdigit() and old_rv.isdigit() and int(new_rv) < int(old_rv):
                return
        self._seen[key] = (time.monotonic(), dict(obj))

    def _is_kept(self, key: tuple) -> bool:
        api_version, kind, namespace, _name = key
        return (api_version, kind, namespace) in self._watched or (api_version, kind, None) in self._watched \
            or (api_version, kind) in self._remembered

    # ----------------------------------------------------------------- our own watch
    async def watch_stream(self, api_version: str, kind: str, namespace: str | None = None, *,
                           field_selector: str | None = None, timeout_seconds: int = 1800,
                           retry_seconds: float = 1.0) -> AsyncIterator[tuple[str, dict]]:
        """Follow the objects of a kind (in ``namespace``, or cluster-wide for None; only those
        ``field_selector`` matches when given): yields ``(event type, object)``, first ``ADDED``
        for each listed object, then the watch's events.

        The watch resumes from the last resourceVersion it saw (bookmarks advance it without
        an event), so a watch the server ends after ``timeout_seconds`` costs one request; only
        410 Gone costs a LIST again, whose differences are yielded (``DELETED`` for an object
        gone meanwhile, with its name only). Errors are logged and retried after
        ``retry_seconds`` (doubling up to 30 s); the generator never returns on its own.

        For a watch that lives and dies with one task (kopf's watches live as long as the
        operator): the operator uses it to wait for one missing Node by name.
        """
        prefix, plural, namespaced = KINDS[(api_version, kind)]
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced and namespace else f"{prefix}/{plural}"
        selector = {"fieldSelector": field_selector} if field_selector else {}
        known: set[tuple[str | None, str]] = set()
        version: str | None = None
        delay = retry_seconds
        while True:
            try:
                if version is None:
                    listing = await self.request("GET", path, query=selector or None)
                    version = (listing.get("metadata") or {}).get("resourceVersion") or None
                    fresh: dict[tuple[str | None, str], dict] = {}
                    for item in listing.get("items") or ():
                        item = {"apiVersion": api_version, "kind": kind, **item}  # list items lack them
                        meta = item["metadata"]
                        fresh[(meta.get("namespace"), meta["name"])] = item
                    for ns, name in sorted(known - set(fresh), key=str):
                        yield "DELETED", {"apiVersion": api_version, "kind": kind,
                                          "metadata": {"name": name, **({"namespace": ns} if ns else {})}}
                    known = set(fresh)
                    for item in fresh.values():
                        yield "ADDED", item
                opened = time.monotonic()
                async with contextlib.aclosing(self._watch_once(path, plural, version, timeout_seconds,
                                                                    selector)) as events:
                    async for event_type, obj in events:
                        delay = retry_seconds
                        meta = obj.get("metadata") or {}
                        if event_type == "ERROR":
                            if obj.get("code") == 410:
                                log.info("watch of %s: %s; listing again", plural, obj.get("message", "410 Gone"))
                                version = None
                                break
                            raise KubeError(f"watch of {plural}: {obj.get('code')} {obj.get('message')}",
                                            status=int(obj.get("code") or 0))
                        version = meta.get("resourceVersion") or version
                        if event_type == "BOOKMARK":
                            continue
                        key = (meta.get("namespace"), meta.get("name", ""))
                        if event_type == "DELETED":
                            known.discard(key)
                        else:
                            known.add(key)
                        yield event_type, obj
                if time.monotonic() - opened < retry_seconds:
                    await asyncio.sleep(retry_seconds)  # a server that ends watches at once must not spin us
            except KubeError as exc:
                if exc.status == 410:
                    version = None
                    continue
                log.warning("watch of %s failed, again in %.0f s: %s", plural, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _watch_once(self, path: str, plural: str, version: str | None, timeout_seconds: int,
                          selector: Mapping[str, str] | None = None) -> AsyncIterator[tuple[str, dict]]:
        """One watch request from ``version``: its events until the server ends it."""
        query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds),
                 **(selector or {})}
        if version:
            query["resourceVersion"] = version
        headers = {"Accept": "application/json", **self._credentials.headers()}
        # The server ends the watch after timeout_seconds; silence longer than that means a dead peer.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.sock_connect,
                                        sock_read=timeout_seconds + 60)
        try:
            async with self._http().get(self._credentials.server + path, params=query, headers=headers,
                                        timeout=timeout) as response:
                self._on_request("watch", plural, response.status)
                if response.status != 200:
                    text = await response.text()
                    raise KubeError(f"watch of {plural}: {response.status}: {text[:300]}", status=response.status)
                buffer = b""
                # Lines, split by hand: aiohttp's readline refuses lines over 64 KiB (a Node's status can be).
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line, buffer = buffer[:end], buffer[end + 1:]
                        if line.strip():
                            event = json.loads(line)
                            yield event.get("type", ""), event.get("object") or {}
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise KubeError(f"watch of {plural}: {exc.__class__.__name__}: {exc}") from exc

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
        self._remember(key, obj)
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
        want = _comparable(desired)
        self._desired[key] = want
        current = self.peek(key)
        if current is None:
            try:
                code, obj = await self._apply(desired, force=False)
                return ("created" if code == 201 else "unchanged"), obj
            except NotFound:
                # RBAC kinds refuse an apply that creates when the caller may not escalate (the
                # API server answers 404 instead of creating): create them the classic way.
                obj = await self.request("POST", path_of(api_version, kind, namespace), body=desired)
                self._remember(key, obj)
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
            self._seen.pop(key, None)  # read it fresh next time
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
        self._remember(key, obj)
        return code, obj

    def peek(self, key: tuple) -> dict | None:
        """What the watches last saw of an object (a copy), or None when not seen or too old."""
        if key in self._seen:
            seen_at, obj = self._seen[key]
            if time.monotonic() - seen_at < self.cache_seconds:
                return copy.deepcopy(obj)
        return None

    def freshest(self, obj: Mapping[str, Any]) -> Mapping[str, Any]:
        """``obj``, or the cache's copy of it when that is newer (a higher resourceVersion): a
        reconcile handed an event's body that our own status write has since overtaken must not
        write the same status (and send the same event) again."""
        meta = obj.get("metadata") or {}
        key = (obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace"), meta.get("name", ""))
        cached = self._seen.get(key)
        if cached is None:
            return obj
        mine, theirs = meta.get("resourceVersion", ""), cached[1].get("metadata", {}).get("resourceVersion", "")
        if mine.isdigit() and theirs.isdigit() and int(theirs) > int(mine):
            return copy.deepcopy(cached[1])
        return obj

    def drifted(self, obj: Mapping[str, Any]) -> bool:
        """Whether a watched object no longer says what the operator last applied to it (a hand
        edit: the owner must be reconciled). Our own writes' echoes and status-only changes are
        not drift."""
        meta = obj.get("metadata") or {}
        key = (obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace"), meta.get("name", ""))
        want = self._desired.get(key)
        return want is not None and not meta.get("deletionTimestamp") and not is_subset(want, obj)

    def forget(self) -> None:
        """Drop every cached object, so the next reads go to the API server (the full resync)."""
        self._seen.clear()
        self._crd_cache.clear()

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
            self._seen.pop((api_version, kind, namespace, name), None)
            self._desired.pop((api_version, kind, namespace, name), None)

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
            self._seen.pop(key, None)
            raise
        self._remember(key, patched)

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
            self._seen.pop(key, None)
            raise
        self._remember(key, patched)

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
        data = (secret.get("data") or {}).get(key)
        if data is None:
            return SecretCheck(found=True, has_key=False)
        try:
            text = base64.b64decode(data).decode("utf-8")
        except ValueError:  # binascii.Error and UnicodeDecodeError: no usable keys
            return SecretCheck(found=True, has_key=True, key_count=0)
        hashes = tuple(manifests.key_hashes(text))
        return SecretCheck(found=True, has_key=True, key_count=len(hashes), key_hashes=hashes)

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
        namespace = meta.get("namespace") or EVENT_NAMESPACE_FOR_CLUSTER_OBJECTS
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
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
            "reportingInstance": self.identity[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.request("POST", path_of("v1", "Event", namespace), body=body)
        except KubeError as exc:
            log.warning("could not record event %s on %s/%s: %s", reason, involved.get("kind"), meta["name"], exc)
