"""Review finding 16: runtime pods (vLLM on untrusted prompts) could reach anything: the cloud
metadata endpoint, the API server's every port, the internet; the operator's pod took ingress from
anywhere. Now each runtime's NetworkPolicy also restricts egress (DNS, the API server, ClickHouse when
configured, the model hub when a model is downloaded; never link-local), and the chart puts a
default-deny ingress policy on the operator that admits only the metrics scrapers."""

from __future__ import annotations

import ipaddress
import pathlib

import pytest

from tests.regression.manifest_fixtures import CONFIG, inode
from zerolayer.operator import manifests as m

pytestmark = [pytest.mark.regression]

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "zerolayer"
METADATA = ipaddress.ip_address("169.254.169.254")


def egress(**spec) -> list[dict]:  # type: ignore[no-untyped-def]
    policy = m.build_runtime_networkpolicy(inode(**spec), CONFIG)
    assert "Egress" in policy["spec"]["policyTypes"]
    return policy["spec"]["egress"]


def reachable_ports(rules: list[dict]) -> set:
    return {(p.get("protocol", "TCP"), p.get("port")) for r in rules for p in r.get("ports") or [{"port": "any"}]}


def test_runtime_egress_is_dns_and_the_api_server_only_by_default():
    rules = egress()
    assert reachable_ports(rules) == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443)}
    for rule in rules:
        for peer in rule.get("to") or []:
            block = peer.get("ipBlock")
            if block:
                net = ipaddress.ip_network(block["cidr"])
                assert METADATA not in net or any(METADATA in ipaddress.ip_network(e) for e in block.get("except", ()))
        assert rule.get("to"), "a rule without 'to' reaches every address"


def test_clickhouse_port_is_opened_only_when_configured():
    rules = egress(audit={"store": "clickhouse", "clickhouseUrl": "http://ch.audit:9000/zl"})
    assert ("TCP", 9000) in reachable_ports(rules)


def test_chart_denies_ingress_to_the_operator_except_scrapers():
    text = (CHART / "templates" / "networkpolicy.yaml").read_text()
    assert "kind: NetworkPolicy" in text and "policyTypes" in text and "metricsScraperNamespaces" in text
