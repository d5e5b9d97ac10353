"""Review finding 21: the operator ran kopf standalone (no peering), but the chart allowed several
replicas and promised standbys: with replicas > 1 several operators reconciled at once. First fixed
by allowing 0 or 1; since issue 16 the replicas elect a leader through a Lease (operator/leader.py),
so the standbys the chart offers are real: every replica is started with leader election on and the
chart grants the Lease it needs (tests/e2e/test_operator_failover.py shows only one acts)."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest
import yaml

pytestmark = [pytest.mark.regression]

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "zerolayer"


def test_several_replicas_are_allowed_because_they_elect_a_leader():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)  # the chart's $schema
    validator.validate(values)
    assert values["operator"]["replicas"] >= 2  # one leads, the rest stand by
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert "name: ZEROLAYER_LEADER_ELECTION\n              value: \"true\"" in deployment


def test_the_chart_grants_the_lease_the_replicas_elect_with():
    rbac = (CHART / "templates" / "rbac.yaml").read_text()
    assert "resources: [leases]" in rbac and "coordination.k8s.io" in rbac
