"""Review finding 21: the operator runs kopf standalone (no peering), but the chart allowed up to 3
replicas and promised standbys: with replicas > 1 several operators reconciled at once. The schema
now allows 0 or 1, and the values comment says why."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest
import yaml

pytestmark = [pytest.mark.regression]

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "zerolayer"


def test_schema_refuses_more_than_one_replica():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)  # the chart's $schema
    validator.validate(values)
    values["operator"]["replicas"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(values)


def test_values_do_not_promise_standbys():
    assert "standby" not in (CHART / "values.yaml").read_text().lower()
