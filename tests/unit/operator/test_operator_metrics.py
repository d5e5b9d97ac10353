"""The operator's own series (issue 30): what the chart's operator panels and ZerolayerOperatorNoLeader read."""

from __future__ import annotations

from zerolayer.operator.metrics import OperatorMetrics


def test_the_leader_gauge_follows_the_lease_and_reconciles_count_by_kind_and_result():
    metrics = OperatorMetrics()
    value = metrics.registry.get_sample_value
    assert value("zerolayer_operator_leader") == 0  # a standby until it holds the Lease
    metrics.leading(True)
    assert value("zerolayer_operator_leader") == 1
    metrics.observe("InferenceNode", "ready")
    assert value("zerolayer_operator_reconciles_total", {"kind": "InferenceNode", "result": "ready"}) == 1
    metrics.leading(False)
    assert value("zerolayer_operator_leader") == 0
