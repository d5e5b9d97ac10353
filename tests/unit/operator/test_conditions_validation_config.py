import datetime

import pytest

from zerolayer.operator import conditions as cond
from zerolayer.operator import validation
from zerolayer.operator.config import OperatorConfig
from zerolayer.operator.errors import ConfigError

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(minutes=5)


def test_transition_time_moves_only_when_status_changes():
    first = cond.merge_conditions([], [cond.condition("Ready", False, "Waiting", "w")], generation=1, now=T0)
    assert first == [{"type": "Ready", "status": "False", "reason": "Waiting", "message": "w",
                      "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    same = cond.merge_conditions(first, [cond.condition("Ready", False, "Other", "o")], generation=2, now=T1)
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    flipped = cond.merge_conditions(same, [cond.condition("Ready", True, "Ok", "ok")], generation=2, now=T1)
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_merge_is_idempotent_and_keeps_order():
    updates = [cond.condition("A", True, "r", "m"), cond.condition("B", cond.UNKNOWN, "r", "m")]
    once = cond.merge_conditions([], updates, generation=3, now=T0)
    assert cond.merge_conditions(once, updates, generation=3, now=T1) == once
    assert [c["type"] for c in once] == ["A", "B"]
    assert cond.is_true(once, "A") and not cond.is_true(once, "B")
    with pytest.raises(ValueError):
        cond.condition("X", "maybe", "r", "m")


@pytest.mark.parametrize("spec, fragment", [
    ({}, "nodeName is required"),
    ({"nodeName": "n", "models": []}, "at least one model"),
    ({"nodeName": "n", "models": [{"name": "a", "default": True}, {"name": "b", "default": True}]}, "only one model"),
    ({"nodeName": "n", "models": [{"name": "a"}], "scheduler": {"resumeThreshold": 0.95, "memoryThreshold": 0.9}},
     "resumeThreshold must be below"),
    ({"nodeName": "n", "models": [{"name": "a"}], "gossip": {"heartbeatSeconds": 30, "staleAfterSeconds": 10}},
     "must exceed"),
    ({"nodeName": "n", "models": [{"name": "a"}], "runtime": {"serverCore": "rust"}},
     "spec.runtime.serverCore must be one of python, native, got 'rust'"),
])
def test_inference_node_problems(spec, fragment):
    assert any(fragment in p for p in validation.inference_node_problems(spec))


def test_valid_specs_have_no_problems():
    assert validation.inference_node_problems({"nodeName": "n", "models": [{"name": "a"}, {"name": "b"}]}) == []
    for core in ("python", "native"):
        assert validation.inference_node_problems({"nodeName": "n", "models": [{"name": "a"}],
                                                   "runtime": {"serverCore": core}}) == []
    assert validation.tenant_quota_problems({"tenant": "t", "apiKeySecretRef": {"name": "s"}, "namespaces": ["a"],
                                             "tokensPerMinute": 1, "requestsPerMinute": 1}) == []


@pytest.mark.parametrize("patch, fragment", [
    ({"tokensPerMinute": -1}, "tokensPerMinute must be a positive integer"),
    ({"apiKeySecretRef": {}}, "apiKeySecretRef.name is required"),
    ({"namespaces": []}, "at least one namespace"),
    ({"allowedPriorities": ["urgent"]}, "unknown values"),
])
def test_tenant_quota_problems(patch, fragment):
    spec = {"tenant": "t", "apiKeySecretRef": {"name": "s"}, "namespaces": ["a"], "tokensPerMinute": 1,
            "requestsPerMinute": 1, **patch}
    assert any(fragment in p for p in validation.tenant_quota_problems(spec))


def test_config_from_chart_environment():
    cfg = OperatorConfig.from_env({
        "ZEROLAYER_RUNTIME_NAMESPACE": "rt", "ZEROLAYER_RUNTIME_PORT": "9443",
        "ZEROLAYER_RUNTIME_RESOURCES": '{"requests": {"cpu": "1"}}',
        "ZEROLAYER_METRICS_SCRAPER_NAMESPACES": "mon, prom",
    })
    assert cfg.runtime_namespace == "rt" and cfg.operator_namespace == "rt"
    assert cfg.runtime_port == 9443 and cfg.metrics_scraper_namespaces == ("mon", "prom")
    assert cfg.runtime_resources == {"requests": {"cpu": "1"}}
    assert OperatorConfig.from_env({}, runtime_namespace="x", resync_seconds=2).resync_seconds == 2


@pytest.mark.parametrize("env", [
    {"ZEROLAYER_RUNTIME_PORT": "http"}, {"ZEROLAYER_RUNTIME_NAMESPACE": "Bad_NS"},
    {"ZEROLAYER_RUNTIME_RESOURCES": "{not json"}, {"ZEROLAYER_RUNTIME_IMAGE_PULL_POLICY": "Sometimes"},
    {"ZEROLAYER_API_SERVER_PORTS": "https"}, {"ZEROLAYER_API_SERVER_PORTS": "0"},
])
def test_bad_config_is_a_config_error(env):
    with pytest.raises(ConfigError):
        OperatorConfig.from_env(env)
