"""Every Kubernetes API call the runtime side makes (gossip publisher and gpu-defragd) lives here.

Calls are blocking (the official client); callers run them in their own threads, never on
the event loop. Every failure (an API error status, a refused connection, a timeout) is
converted to :class:`~zerolayer.runtime.gossip.errors.KubeApiError` here, so an API server
that goes away is an error value for the caller, never a crash.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from zerolayer import kubeaccess
from zerolayer.gpumap import GROUP, KIND, PLURAL, VERSION, utc_now_rfc3339

from .errors import KubeApiError

log = logging.getLogger(__name__)

EVENT_NAMESPACE = "default"  # InferenceNode is cluster-scoped; Events about such objects live in "default"


def _client_modules():  # type: ignore[no-untyped-def]
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return client, config, ApiException, HTTPError


def load_api_client(kubeconfig: str | None = None) -> Any:
    """An ``ApiClient`` from ``kubeconfig``, else in-cluster config, else the default kubeconfig.

    Configuration is per client (not the library's global default), so a test process can
    hold several. Raises KubeApiError when there is no usable configuration.
    """
    try:
        # retries=1: a gone API server should fail fast; the publisher has its own backoff
        return kubeaccess.api_client(kubeconfig, retries=1)
    except kubeaccess.KubeConfigError as exc:
        raise KubeApiError(str(exc)) from exc


class NodeApi:
    """The runtime's view of its own ``InferenceNode``: read it, merge-patch its status, record Events."""

    def __init__(self, api_client: Any = None, *, kubeconfig: str | None = None, timeout_s: float = 5.0,
                 component: str = "zerolayer-runtime") -> None:
        client, _, self._ApiException, self._HTTPError = _client_modules()
        self._api_client = api_client if api_client is not None else load_api_client(kubeconfig)
        self._custom = client.CustomObjectsApi(self._api_client)
        self._core = client.CoreV1Api(self._api_client)
        self.timeout_s = timeout_s
        self.component = component
        self.calls = 0

    def _convert(self, what: str, exc: Exception) -> KubeApiError:
        if isinstance(exc, self._ApiException):
            return KubeApiError(f"{what}: HTTP {exc.status} {exc.reason}", exc.status)
        return KubeApiError(f"{what}: API server unreachable ({exc.__class__.__name__}: {exc})")

    def get(self, name: str) -> dict[str, Any]:
        """The InferenceNode ``name`` as a dict."""
        self.calls += 1
        try:
            return self._custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name,
                                                          _request_timeout=self.timeout_s)
        except (self._ApiException, self._HTTPError, OSError) as exc:
            raise self._convert(f"cannot read InferenceNode {name}", exc) from exc

    def patch_status(self, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch ``status`` into the status subresource; returns the updated object."""
        self.calls += 1
        try:
            return self._custom.patch_cluster_custom_object_status(
                GROUP, VERSION, PLURAL, name, {"status": dict(status)}, _request_timeout=self.timeout_s)
        except (self._ApiException, self._HTTPError, OSError) as exc:
            raise self._convert(f"cannot patch the status of InferenceNode {name}", exc) from exc

    def create_event(self, node: Mapping[str, Any], *, reason: str, message: str, action: str,
                     type_: str = "Normal") -> dict[str, Any]:
        """Record a core/v1 Event about the InferenceNode ``node`` (the object as read)."""
        metadata = node.get("metadata") or {}
        name = str(metadata.get("name", ""))
        now = utc_now_rfc3339()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": EVENT_NAMESPACE},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name,
                               "uid": metadata.get("uid")},
            "reason": reason, "message": message[:1024], "type": type_, "action": action,
            "source": {"component": self.component}, "reportingComponent": self.component,
            "reportingInstance": name, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.calls += 1
        try:
            created = self._core.create_namespaced_event(EVENT_NAMESPACE, body, _request_timeout=self.timeout_s)
        except (self._ApiException, self._HTTPError, OSError) as exc:
            raise self._convert(f"cannot record Event {reason} for InferenceNode {name}", exc) from exc
        return self._api_client.sanitize_for_serialization(created)

    def close(self) -> None:
        self._api_client.close()
