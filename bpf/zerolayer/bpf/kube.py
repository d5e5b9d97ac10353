"""Every Kubernetes API call the auditor makes: read TenantQuotas, write their ``status.usage``,
look up a pod's UID for ``--pod``, and record the mode it meters in as an Event on its pod.

Several nodes' auditors write the same cluster-scoped TenantQuota. Each keeps its own node's
figures under ``status.usage.nodes.<node>`` (a merge patch touches only that key), and the
top-level usage fields are the **fleet sum** over those entries, written in the same patch with
the object's ``resourceVersion`` as a precondition: if another writer got in between, the patch
is refused (409), the object is read again and the sum recomputed. Window fields
(``tokensThisWindow``, ``requestsThisWindow``) add up only the entries of the current window.

Writes are bounded: at most one status patch per tenant per ``min_interval_s``, and none when
this node's usage did not change. Reads are a watch, not a poll: with ``TenantQuotaApi.watch()``
the writer keeps every TenantQuota current from one LIST and then watch events
(:class:`zerolayer.kubewatch.WatchLoop`), so tenants and prices added after the auditor started
are seen within a status cycle at no read cost. Kubernetes errors become :class:`QuotaStatusError`.
"""

from __future__ import annotations

import datetime
import decimal
import logging
from decimal import Decimal
from typing import Any, Callable, Mapping, cast

from zerolayer import kubeaccess
from zerolayer.bpf.errors import AuditError, QuotaStatusConflict, QuotaStatusError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "zerolayer.io", "v1alpha1", "tenantquotas"


def _rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")




class TenantQuotaApi:
    """The calls the auditor needs, behind one small wrapper (tests substitute this class)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        try:
            from kubernetes import client

            self._api = client.CustomObjectsApi(kubeaccess.api_client(kubeconfig))
        except Exception as exc:  # kubernetes raises several unrelated types for bad configs
            raise QuotaStatusError(f"cannot configure the Kubernetes client: {exc}") from exc

    def watch(self) -> Any:
        """A started :class:`zerolayer.kubewatch.WatchLoop` over every TenantQuota."""
        from zerolayer.kubewatch import WatchLoop

        return WatchLoop(self._api.list_cluster_custom_object, GROUP, VERSION, PLURAL, name="auditor-tenantquotas",
                         retry_s=5.0).start()

    def list(self) -> list[dict[str, Any]]:
        try:
            listing = cast(Mapping[str, Any], self._api.list_cluster_custom_object(GROUP, VERSION, PLURAL))
            return list(listing.get("items", []))
        except Exception as exc:
            raise QuotaStatusError(f"cannot list TenantQuotas: {exc}") from exc

    def get(self, name: str) -> dict[str, Any]:
        try:
            return dict(cast(Mapping[str, Any], self._api.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)))
        except Exception as exc:
            raise QuotaStatusError(f"cannot read TenantQuota {name}: {exc}") from exc

    def patch_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch on the status subresource; returns the object as written. A
        ``metadata.resourceVersion`` in ``patch`` is a precondition (:class:`QuotaStatusConflict` on 409)."""
        try:
            written = self._api.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, dict(patch))
            return dict(cast(Mapping[str, Any], written))
        except Exception as exc:
            if getattr(exc, "status", None) == 409:
                raise QuotaStatusConflict(f"TenantQuota {name} changed while its status was written") from exc
            raise QuotaStatusError(f"cannot patch TenantQuota {name} status: {exc}") from exc


def pod_uid(ref: str, kubeconfig: str | None = None) -> str:
    """UID of the pod ``NAMESPACE/NAME`` (in-cluster config first, then the kubeconfig)."""
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name:
        raise AuditError(f"--pod takes NAMESPACE/NAME, not {ref!r}")
    try:
        from kubernetes import client

        pod = client.CoreV1Api(kubeaccess.api_client(kubeconfig)).read_namespaced_pod(name, namespace)
    except Exception as exc:  # config errors, ApiException (404, 403), connection errors
        reason = getattr(exc, "reason", None) or exc
        raise AuditError(f"cannot look up pod {ref}: {reason}") from exc
    if pod.metadata is None or not pod.metadata.uid:
        raise AuditError(f"pod {ref} has no uid")
    return str(pod.metadata.uid)


def record_pod_event(ref: str, *, uid: str | None, reason: str, message: str, warning: bool = False,
                     kubeconfig: str | None = None) -> None:
    """A core/v1 Event about the pod ``NAMESPACE/NAME`` (shown by ``kubectl describe pod``).

    ``uid`` (the downward API's ``metadata.uid``) ties the Event to this incarnation of the pod.
    Errors become :class:`AuditError`: the caller decides whether metering goes on without it."""
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name:
        raise AuditError(f"--mode-event-pod takes NAMESPACE/NAME, not {ref!r}")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                           **({"uid": uid} if uid else {}), "fieldPath": "spec.containers{auditor}"},
        "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
        "source": {"component": "zerolayer-auditor"}, "reportingComponent": "zerolayer-auditor",
        "reportingInstance": name, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        from kubernetes import client

        # The client serialises a plain dict body as it is (its stubs name only CoreV1Event).
        client.CoreV1Api(kubeaccess.api_client(kubeconfig)).create_namespaced_event(namespace, cast(Any, body))
    except Exception as exc:  # config errors, ApiException (403), connection errors
        raise AuditError(f"cannot record Event {reason} on pod {ref}: {getattr(exc, 'reason', None) or exc}") from exc


class QuotaStatusWriter:
    """Publishes this node's usage to ``TenantQuota.status.usage.nodes.<node>`` and the fleet sum beside it."""

    def __init__(self, api: Any, *, node: str = "local", min_interval_s: float = 15.0,
                 clock: Callable[[], float] | None = None, max_attempts: int = 3, watch: Any = None) -> None:
        """``watch``: a WatchLoop over TenantQuotas (``api.watch()``); None: LIST on every :meth:`refresh`."""
        import time

        self.api = api
        self.watch = watch
        self.node = node
        self.min_interval_s = min_interval_s
        self.max_attempts = max_attempts
        self.clock = clock or time.time
        self._last: dict[str, tuple[float, tuple[Any, ...]]] = {}  # tenant -> (when, usage without lastUpdate)
        self._quotas: dict[str, Mapping[str, Any]] = {}  # tenant -> TenantQuota as last read or written
        self.names: dict[str, str] = {}  # tenant -> TenantQuota name
        self.patches = 0
        self.conflicts = 0

    def refresh(self) -> list[dict[str, Any]]:
        """Every TenantQuota (the auditor calls this every status cycle: new tenants, new prices): from the
        watch's cache when there is one (no request; a LIST until its first listing arrived), else one LIST."""
        if self.watch is not None and self.watch.started.is_set():
            quotas = list(self.watch.objects.values())
        else:
            quotas = self.api.list()
        self._quotas = {str(q["spec"]["tenant"]): q for q in quotas if (q.get("spec") or {}).get("tenant")}
        self.names = {t: q["metadata"]["name"] for t, q in self._quotas.items()}
        return quotas

    def publish(self, usage: Mapping[str, Mapping[str, Any]]) -> int:
        """``usage``: tenant -> this node's CRD usage fields without ``lastUpdate``. Returns patches sent."""
        now = self.clock()
        sent = 0
        for tenant, fields in usage.items():
            quota = self._quotas.get(tenant)
            if quota is None:
                continue
            key = tuple(sorted(fields.items()))
            last = self._last.get(tenant)
            if last is not None and (now - last[0] < self.min_interval_s or last[1] == key):
                continue
            if self._write(tenant, quota, {**fields, "lastUpdate": _rfc3339(now)}):
                self._last[tenant] = (now, key)
                sent += 1
        self.patches += sent
        return sent

    def _write(self, tenant: str, quota: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
        name = quota["metadata"]["name"]
        for _ in range(self.max_attempts):
            try:
                written = self.api.patch_status(name, fleet_patch(quota, self.node, entry))
            except QuotaStatusConflict:
                self.conflicts += 1
                quota = self.api.get(name)
                continue
            self._quotas[tenant] = written if isinstance(written, Mapping) and written.get("metadata") else quota
            return True
        log.warning("TenantQuota %s: status changed under us %d times in a row; trying again next cycle", name,
                    self.max_attempts)
        return False


def fleet_patch(quota: Mapping[str, Any], node: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that sets this node's entry and the fleet sum, conditional on ``quota``'s version."""
    usage = (quota.get("status") or {}).get("usage") or {}
    nodes = dict(usage.get("nodes") or {}) if isinstance(usage.get("nodes"), Mapping) else {}
    nodes[node] = dict(entry)
    patch: dict[str, Any] = {"status": {"usage": {**fleet_sum(nodes, str(entry.get("windowStart", ""))),
                                                  "lastUpdate": entry.get("lastUpdate"), "nodes": {node: dict(entry)}}}}
    version = (quota.get("metadata") or {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


def fleet_sum(nodes: Mapping[str, Any], window_start: str) -> dict[str, Any]:
    """Top-level usage fields from the per-node entries (entries of another window add no window figures)."""
    def count(e: Mapping[str, Any], k: str) -> int:
        v = e.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

    entries = [e for e in nodes.values() if isinstance(e, Mapping)]
    current = [e for e in entries if e.get("windowStart") == window_start]
    cost = Decimal(0)
    for e in entries:
        try:
            value = Decimal(str(e.get("cost", "0")))
        except decimal.InvalidOperation:
            continue
        if value.is_finite() and value >= 0:
            cost += value
    return {"windowStart": window_start,
            "tokensThisWindow": sum(count(e, "tokensThisWindow") for e in current),
            "requestsThisWindow": sum(count(e, "requestsThisWindow") for e in current),
            "inputTokensTotal": sum(count(e, "inputTokensTotal") for e in entries),
            "outputTokensTotal": sum(count(e, "outputTokensTotal") for e in entries),
            "cost": str(cost)}


def usage_fields(window_start: float, window_tokens: int, window_requests: int, input_total: int,
                 output_total: int, cost: str) -> dict[str, Any]:
    return {"windowStart": _rfc3339(window_start), "tokensThisWindow": window_tokens,
            "requestsThisWindow": window_requests, "inputTokensTotal": input_total,
            "outputTokensTotal": output_total, "cost": cost}
