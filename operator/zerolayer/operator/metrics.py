"""The operator's Prometheus metrics, in their own registry (served on ``--metrics-port``)."""

from __future__ import annotations

import prometheus_client as prom


class OperatorMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None):
        self.registry = registry or prom.CollectorRegistry()
        self.api_requests = prom.Counter(
            "zerolayer_operator_api_requests", "Kubernetes API requests the operator made (its own, not kopf's).",
            ["verb", "resource", "code"], registry=self.registry)
        self.reconciles = prom.Counter(
            "zerolayer_operator_reconciles", "Reconciliations by kind and result.",
            ["kind", "result"], registry=self.registry)
        self.leader = prom.Gauge(
            "zerolayer_operator_leader",
            "1 while this replica holds the leader Lease and acts (always, without leader election); 0 on standby.",
            registry=self.registry)

    def leading(self, holds: bool) -> None:
        self.leader.set(1 if holds else 0)

    def on_request(self, verb: str, resource: str, code: int) -> None:
        self.api_requests.labels(verb, resource, str(code)).inc()

    def observe(self, kind: str, result: str) -> None:
        self.reconciles.labels(kind, result).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Start the /metrics HTTP server (prometheus_client's own thread)."""
        prom.start_http_server(port, addr=addr, registry=self.registry)
