"""``server.max_connection_age_s`` and its grace: parsing, defaults, the refusal of bad values (naming the
field), the in-cluster mapping from ``spec.runtime``, and the per-connection jitter. The behaviour over
real sockets is tests/integration/runtime/test_connection_age.py."""

from __future__ import annotations

import pathlib

import pytest

from zerolayer.runtime.compose import build_connection_age
from zerolayer.runtime.config import parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.incluster import config_from_inferencenode
from zerolayer.runtime.serving.transport import ConnectionAge


def config(**server):  # type: ignore[no-untyped-def]
    return parse_config({"engine": {"kind": "synthetic"}, "server": {"core": "python", **server},
                         "limits": {"drain_timeout_s": 45}}, pathlib.Path.cwd())


def test_off_by_default():
    parsed = config()
    assert parsed.max_connection_age_s is None and parsed.max_connection_age_grace_s is None
    assert build_connection_age(parsed) is None


def test_the_grace_defaults_to_the_drain_timeout():
    assert build_connection_age(config(max_connection_age_s=600)) == ConnectionAge(600.0, 45.0)
    assert build_connection_age(config(max_connection_age_s=0.5, max_connection_age_grace_s=0)) == ConnectionAge(0.5, 0.0)
    assert build_connection_age(config(max_connection_age_s=None)) is None  # null: off, as unset


@pytest.mark.parametrize("field, value", [
    ("max_connection_age_s", 0), ("max_connection_age_s", -5), ("max_connection_age_s", "10m"),
    ("max_connection_age_s", True), ("max_connection_age_s", float("inf")), ("max_connection_age_s", [1]),
    ("max_connection_age_grace_s", -1), ("max_connection_age_grace_s", "30"), ("max_connection_age_grace_s", float("nan")),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^server\.{field}: a number of seconds"):
        config(**{"max_connection_age_s": 60, field: value})


def test_unknown_server_keys_list_the_age_fields():
    with pytest.raises(ConfigError, match="max_connection_age_s, max_connection_age_grace_s"):
        config(max_connection_age=60)


def test_spec_runtime_maps_onto_the_server_section():
    node = {"metadata": {"name": "n"}, "spec": {"nodeName": "n", "models": [{"name": "synthetic", "source": "/m"}],
                                                "runtime": {"engine": "synthetic", "maxConnectionAgeSeconds": 900,
                                                            "maxConnectionAgeGraceSeconds": 20, "drainSeconds": 120}}}
    mapping = config_from_inferencenode(node, {"server": {"core": "python"}})
    assert mapping["server"] == {"core": "python", "max_connection_age_s": 900, "max_connection_age_grace_s": 20}
    assert build_connection_age(parse_config(mapping, pathlib.Path.cwd())) == ConnectionAge(900.0, 20.0)
    del node["spec"]["runtime"]["maxConnectionAgeGraceSeconds"]  # the grace follows drainSeconds
    assert build_connection_age(parse_config(config_from_inferencenode(node, {"server": {"core": "python"}}),
                                             pathlib.Path.cwd())) == ConnectionAge(900.0, 120.0)


def test_each_connection_draws_its_age_within_ten_percent():
    age = ConnectionAge(100.0, 5.0)
    assert age.draw(lambda: 0.0) == pytest.approx(90.0) and age.draw(lambda: 1.0) == pytest.approx(110.0)
    draws = {round(age.draw(), 6) for _ in range(200)}
    assert len(draws) > 100 and all(90.0 <= d <= 110.0 for d in draws)


@pytest.mark.parametrize("bad", [dict(max_age_s=0, grace_s=1), dict(max_age_s=1, grace_s=-1),
                                 dict(max_age_s=1, grace_s=1, jitter=1.0)])
def test_connection_age_refuses_what_the_config_would(bad):
    with pytest.raises(ValueError, match="ConnectionAge"):
        ConnectionAge(**bad)
