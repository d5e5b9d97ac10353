"""The operator's settings: defaults for the runtime pods it creates, and its own knobs.

The Helm chart passes these as environment variables (names below); ``zerolayer
operator`` flags override them. An InferenceNode's ``spec.runtime`` overrides the
runtime defaults per node.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from typing import Any, Mapping

from zerolayer.version import __version__
from zerolayer.operator.errors import ConfigError

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

ENV = {
    "runtime_namespace": "ZEROLAYER_RUNTIME_NAMESPACE",
    "operator_namespace": "ZEROLAYER_OPERATOR_NAMESPACE",
    "runtime_image": "ZEROLAYER_RUNTIME_IMAGE",
    "runtime_image_pull_policy": "ZEROLAYER_RUNTIME_IMAGE_PULL_POLICY",
    "runtime_port": "ZEROLAYER_RUNTIME_PORT",
    "runtime_resources": "ZEROLAYER_RUNTIME_RESOURCES",
    "metrics_scraper_namespaces": "ZEROLAYER_METRICS_SCRAPER_NAMESPACES",
    "tenant_secret_namespaces": "ZEROLAYER_TENANT_SECRET_NAMESPACES",
    "runtime_metrics_port": "ZEROLAYER_RUNTIME_METRICS_PORT",
    "api_server_cidrs": "ZEROLAYER_API_SERVER_CIDRS",
    "api_server_ports": "ZEROLAYER_API_SERVER_PORTS",
    "resync_seconds": "ZEROLAYER_RESYNC_SECONDS",
    "retry_seconds": "ZEROLAYER_RETRY_SECONDS",
    "leader_election": "ZEROLAYER_LEADER_ELECTION",
    "lease_name": "ZEROLAYER_LEASE_NAME",
    "lease_seconds": "ZEROLAYER_LEASE_SECONDS",
    "auditor_kernel_mode": "ZEROLAYER_AUDITOR_KERNEL_MODE",
    "inference_pools": "ZEROLAYER_INFERENCE_POOLS",
    "inference_pool_epp": "ZEROLAYER_INFERENCE_POOL_EPP",
    "inference_pool_epp_port": "ZEROLAYER_INFERENCE_POOL_EPP_PORT",
}


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Settings the operator runs with.

    ``runtime_namespace`` holds every namespaced child (DaemonSets, ServiceAccounts,
    Services, NetworkPolicies) and the fleet's Secret of key hashes; only each runtime's own
    ServiceAccount (by name) may read that Secret, and no runtime reads a tenant's Secret.
    ``runtime_metrics_port``: the runtime's /metrics port, admitted only from the scrapers'
    namespaces. ``api_server_cidrs``: the API server's addresses, for the runtime's egress policy.
    ``api_server_ports``: the ports the API server itself listens on, for the same policy: CNIs
    check egress after the ``kubernetes`` Service's DNAT, so the Service's 443 is not what they see.
    ``tenant_secret_namespaces``: namespaces a TenantQuota's ``apiKeySecretRef`` may name
    besides the tenant's own ``spec.namespaces`` and the runtime namespace.
    ``operator_namespace`` is where the operator's own pod runs (its NetworkPolicy peer).
    ``resync_seconds``: the period of the one full resync (every InferenceNode and TenantQuota
    re-read from the API server and reconciled), jittered by up to ``resync_jitter`` of it so that
    replicas and restarts do not line up. Drift the watches see (a child deleted or edited, a
    node label removed) is repaired at once, not at the resync: the resync only bounds drift no
    watch can see, so it is hours, not seconds.
    ``retry_seconds``: how soon an object that waits for something outside the operator (its
    Node, its Secret, a child name held by another object) is looked at again.
    ``leader_election``: hold the Lease ``lease_name`` in ``operator_namespace`` before acting
    (see operator/leader.py); ``lease_seconds`` is how long a dead leader holds it.
    ``auditor_kernel_mode`` (the chart's ``runtime.auditor.kernelMode``): add ``CAP_SYS_ADMIN`` to the
    auditor so the USDT token probe attaches in the kernel where the node's kernel demands it (6.18,
    measured; docs/security.md). Off: the auditor never holds SYS_ADMIN and, on such kernels,
    meters from the runtime's journal (``audit.mode: auto``).
    ``inference_pools`` (the chart's ``inferencePool.enabled``): make a Gateway API Inference Extension
    ``InferencePool`` per model beside its Service (docs/routing.md); needs the pool CRD installed.
    ``inference_pool_epp``: the Endpoint Picker Service each pool names (``{pool}`` is replaced by the
    pool's name; empty: no ``endpointPickerRef``), on ``inference_pool_epp_port``.
    """

    runtime_namespace: str = "zerolayer-system"
    operator_namespace: str = "zerolayer-system"
    runtime_image: str = f"zerolayer/zerolayer:{__version__}-gpu"  # what hack/build-image.sh --flavour gpu tags
    runtime_image_pull_policy: str = "IfNotPresent"
    runtime_port: int = 8443
    runtime_resources: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "64Gi"}}
    )
    metrics_scraper_namespaces: tuple[str, ...] = ("monitoring",)
    tenant_secret_namespaces: tuple[str, ...] = ()
    runtime_metrics_port: int = 9464
    # Where runtime pods may open connections to the API server (their egress NetworkPolicy).
    # Empty: any address except link-local (the cloud metadata endpoint), on 443 and 6443.
    api_server_cidrs: tuple[str, ...] = ()
    api_server_ports: tuple[int, ...] = (443, 6443)
    resync_seconds: float = 3 * 3600.0
    resync_jitter: float = 0.2
    retry_seconds: float = 30.0
    leader_election: bool = True
    lease_name: str = "zerolayer-operator"
    lease_seconds: float = 60.0
    auditor_kernel_mode: bool = False
    inference_pools: bool = False
    inference_pool_epp: str = ""
    inference_pool_epp_port: int = 9002

    def __post_init__(self) -> None:
        for field in ("runtime_namespace", "operator_namespace"):
            value = getattr(self, field)
            if not _DNS_LABEL.match(value or ""):
                raise ConfigError(f"{field} {value!r} is not a valid namespace name")
        for what, names in (("metrics scraper", self.metrics_scraper_namespaces),
                            ("tenant Secret", self.tenant_secret_namespaces)):
            for ns in names:
                if not _DNS_LABEL.match(ns):
                    raise ConfigError(f"{what} namespace {ns!r} is not a valid namespace name")
        for what, port in (("runtime port", self.runtime_port), ("runtime metrics port", self.runtime_metrics_port)):
            if not 1 <= int(port) <= 65535:
                raise ConfigError(f"{what} {port} is outside 1..65535")
        if int(self.runtime_metrics_port) == int(self.runtime_port):
            raise ConfigError("the runtime's metrics port must differ from its serving port")
        if not self.api_server_ports:
            raise ConfigError("API server ports must not be empty (runtimes read their InferenceNode from it)")
        for port in self.api_server_ports:
            if not 1 <= int(port) <= 65535:
                raise ConfigError(f"API server port {port} is outside 1..65535")
        for cidr in self.api_server_cidrs:
            try:
                ipaddress.ip_network(cidr)
            except ValueError as exc:
                raise ConfigError(f"API server CIDR {cidr!r}: {exc}") from None
        if self.runtime_image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ConfigError(f"runtime image pull policy {self.runtime_image_pull_policy!r}: use Always, IfNotPresent or Never")
        if not self.runtime_image:
            raise ConfigError("runtime image is empty")
        if not isinstance(self.runtime_resources, Mapping) or set(self.runtime_resources) - {"requests", "limits"}:
            raise ConfigError("runtime resources must be an object with only 'requests' and 'limits'")
        if self.resync_seconds <= 0:
            raise ConfigError(f"resync interval must be positive, got {self.resync_seconds}")
        if not 0 <= self.resync_jitter < 1:
            raise ConfigError(f"resync jitter must be in [0, 1), got {self.resync_jitter}")
        if self.retry_seconds <= 0:
            raise ConfigError(f"retry interval must be positive, got {self.retry_seconds}")
        if self.lease_seconds < 3:
            raise ConfigError(f"lease duration must be at least 3 s, got {self.lease_seconds}")
        if not _DNS_LABEL.match(self.lease_name or ""):
            raise ConfigError(f"lease name {self.lease_name!r} is not a valid object name")
        self._check_pool_settings()

    def _check_pool_settings(self) -> None:
        if self.inference_pool_epp and not _DNS_LABEL.match(self.inference_pool_epp.replace("{pool}", "zl-model-x")):
            raise ConfigError(f"InferencePool endpoint picker {self.inference_pool_epp!r} is not a valid Service name "
                              "(with {pool} for the pool's name)")
        if not 1 <= int(self.inference_pool_epp_port) <= 65535:
            raise ConfigError(f"InferencePool endpoint picker port {self.inference_pool_epp_port} is outside 1..65535")

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> "OperatorConfig":
        """Build from the chart's environment variables; non-None ``overrides`` win."""
        values: dict[str, Any] = {}
        for field, var in ENV.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            try:
                if field in ("runtime_port", "runtime_metrics_port", "inference_pool_epp_port"):
                    values[field] = int(raw)
                elif field in ("resync_seconds", "retry_seconds", "lease_seconds"):
                    values[field] = float(raw)
                elif field in ("leader_election", "auditor_kernel_mode", "inference_pools"):
                    if raw.lower() not in ("true", "false", "1", "0"):
                        raise ValueError("use true or false")
                    values[field] = raw.lower() in ("true", "1")
                elif field == "runtime_resources":
                    values[field] = json.loads(raw)
                elif field == "api_server_ports":
                    values[field] = tuple(int(n) for n in raw.split(",") if n.strip())
                elif field in ("metrics_scraper_namespaces", "tenant_secret_namespaces", "api_server_cidrs"):
                    values[field] = tuple(n.strip() for n in raw.split(",") if n.strip())
                else:
                    values[field] = raw
            except ValueError as exc:
                raise ConfigError(f"{var}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "operator_namespace" not in values and "runtime_namespace" in values:
            values["operator_namespace"] = values["runtime_namespace"]
        return cls(**values)
