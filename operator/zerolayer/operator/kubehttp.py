"""HTTP to the Kubernetes API server: credentials, one request, one watch request.

The operator's requests go out through aiohttp on the event loop (nothing blocks it); credentials
come from the kubeconfig or the in-cluster service account, loaded once with the ``kubernetes``
package's loaders. Every failure leaves here as a :class:`~zerolayer.operator.errors.KubeError`
(``NotFound``, ``Conflict`` or the base). :class:`~zerolayer.operator.kube.Kube` is the only user.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any, AsyncGenerator, Callable, Mapping

import aiohttp
from kubernetes import client as k8s_client

from zerolayer import kubeaccess
from zerolayer.operator.errors import Conflict, KubeError, NotFound

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
    ("zerolayer.io/v1alpha1", "InferenceFleet"): ("/apis/zerolayer.io/v1alpha1", "inferencefleets", False),
    ("inference.networking.k8s.io/v1", "InferencePool"):
        ("/apis/inference.networking.k8s.io/v1", "inferencepools", True),
}

APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: server-side apply takes a JSON body
FIELD_MANAGER = "zerolayer-operator"


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


class ApiTransport:
    """Requests to one API server with one set of credentials over a pooled aiohttp session.

    ``on_request(verb, resource, code)`` is called once per API request (metrics); code 0 when no
    answer came.
    """

    def __init__(self, credentials: Credentials, *, on_request: Callable[[str, str, int], None] | None = None,
                 timeout: float = 30.0) -> None:
        self._credentials = credentials
        self._on_request = on_request or (lambda verb, resource, code: None)
        # Per socket operation, not in total: a request waiting for a free connection of the pool
        # (1,000 TenantQuotas reconciled at once share 32) is backpressure, not a dead API server.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._credentials.ssl, limit=32), timeout=self._timeout)
        return self._session

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

    async def watch_once(self, path: str, plural: str, version: str | None, timeout_seconds: int,
                          selector: Mapping[str, str] | None = None) -> AsyncGenerator[tuple[str, dict], None]:
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
