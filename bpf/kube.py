"""Every Kubernetes API call the auditor makes: read TenantQuotas, write their ``status.usage``, and
look up a pod's UID for ``--pod``.

Writes are bounded: at most one status patch per tenant per ``min_interval_s``, and none when
the usage did not change. Kubernetes errors become :class:`QuotaStatusError`.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Mapping

from zerolayer.bpf.errors import AuditError, QuotaStatusError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "zerolayer.io", "v1alpha1", "tenantquotas"


def _rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load_config(kubeconfig: str | None) -> None:
    """The given kubeconfig; else in-cluster, then ~/.kube/config."""
    from kubernetes import config

    if kubeconfig:
        config.load_kube_config(kubeconfig)
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class TenantQuotaApi:
    """The two calls the auditor needs, behind one small wrapper (tests substitute this class)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        try:
            from kubernetes import client

            _load_config(kubeconfig)
            self._api = client.CustomObjectsApi()
        except Exception as exc:  # kubernetes raises several unrelated types for bad configs
            raise QuotaStatusError(f"cannot configure the Kubernetes client: {exc}") from exc

    def list(self) -> list[dict[str, Any]]:
        try:
            return list(self._api.list_cluster_custom_object(GROUP, VERSION, PLURAL).get("items", []))
        except Exception as exc:
            raise QuotaStatusError(f"cannot list TenantQuotas: {exc}") from exc

    def patch_usage(self, name: str, usage: Mapping[str, Any]) -> None:
        try:
            self._api.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, {"status": {"usage": usage}})
        except Exception as exc:
            raise QuotaStatusError(f"cannot patch TenantQuota {name} status: {exc}") from exc


def pod_uid(ref: str, kubeconfig: str | None = None) -> str:
    """UID of the pod ``NAMESPACE/NAME`` (in-cluster config first, then the kubeconfig)."""
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name:
        raise AuditError(f"--pod takes NAMESPACE/NAME, not {ref!r}")
    try:
        from kubernetes import client

        _load_config(kubeconfig)
        pod = client.CoreV1Api().read_namespaced_pod(name, namespace)
    except Exception as exc:  # config errors, ApiException (404, 403), connection errors
        reason = getattr(exc, "reason", None) or exc
        raise AuditError(f"cannot look up pod {ref}: {reason}") from exc
    return str(pod.metadata.uid)


class QuotaStatusWriter:
    """Publishes usage to ``TenantQuota.status.usage`` (field names from the CRD) at a bounded rate."""

    def __init__(self, api: Any, *, min_interval_s: float = 15.0, clock: Callable[[], float] | None = None) -> None:
        import time

        self.api = api
        self.min_interval_s = min_interval_s
        self.clock = clock or time.time
        self._last: dict[str, tuple[float, tuple[Any, ...]]] = {}  # tenant -> (when, usage without lastUpdate)
        self.names: dict[str, str] = {}  # tenant -> TenantQuota name
        self.patches = 0

    def refresh(self) -> list[dict[str, Any]]:
        quotas = self.api.list()
        self.names = {q["spec"]["tenant"]: q["metadata"]["name"] for q in quotas if q.get("spec", {}).get("tenant")}
        return quotas

    def publish(self, usage: Mapping[str, Mapping[str, Any]]) -> int:
        """``usage``: tenant -> CRD usage fields without ``lastUpdate``. Returns patches sent."""
        now = self.clock()
        sent = 0
        for tenant, fields in usage.items():
            name = self.names.get(tenant)
            if name is None:
                continue
            key = tuple(sorted(fields.items()))
            last = self._last.get(tenant)
            if last is not None and (now - last[0] < self.min_interval_s or last[1] == key):
                continue
            self.api.patch_usage(name, {**fields, "lastUpdate": _rfc3339(now)})
            self._last[tenant] = (now, key)
            sent += 1
        self.patches += sent
        return sent


def usage_fields(window_start: float, window_tokens: int, window_requests: int, input_total: int,
                 output_total: int, cost: str) -> dict[str, Any]:
    return {"windowStart": _rfc3339(window_start), "tokensThisWindow": window_tokens,
            "requestsThisWindow": window_requests, "inputTokensTotal": input_total,
            "outputTokensTotal": output_total, "cost": cost}
