"""``spec.gossip.prefixDigestSource`` -> the engine's ``prefix_digest`` in the operator-deployed
runtime's config (runtime/node/incluster.py), and the runtime's own refusal of what the operator refuses
first (tests/unit/operator/test_prefix_digest_source.py). Nothing here starts vLLM."""

from __future__ import annotations

import pathlib

import pytest

from zerolayer.runtime.config import parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.incluster import config_from_inferencenode

REPO = pathlib.Path(__file__).resolve().parents[3]
MODEL = {"name": "m", "source": {"path": "/models/m"}}


def inode(source=None, runtime=None, models=None):  # type: ignore[no-untyped-def]
    gossip = {} if source is None else {"prefixDigestSource": source}
    return {"metadata": {"name": "n"}, "spec": {"nodeName": "n", "models": models or [MODEL],
                                                "runtime": {"engine": "vllm", **(runtime or {})},
                                                "gossip": gossip}}


@pytest.mark.parametrize("source, expected", [(None, None), ("served", "served"), ("kvEvents", "kv_events")])
def test_the_source_maps_to_the_engine_prefix_digest(source, expected):
    engine = config_from_inferencenode(inode(source))["engine"]
    assert engine.get("prefix_digest") == expected
    parse_config(config_from_inferencenode(inode(source)), REPO, environ={})  # the runtime takes it


def test_every_engine_of_a_multi_model_node_gets_it():
    models = [{**MODEL, "gpus": 1, "default": True}, {"name": "b", "source": {"path": "/models/b"}, "gpus": 1}]
    config = config_from_inferencenode(inode("kvEvents", {"gpus": 2}, models))
    assert [e["prefix_digest"] for e in config["engines"]] == ["kv_events", "kv_events"]


@pytest.mark.parametrize("runtime, refusal", [
    ({"engine": "synthetic"}, "kv_events needs the vllm engine"),
    ({"enablePrefixCaching": False}, "kv_events needs enable_prefix_caching"),
])
def test_the_runtime_refuses_what_the_operator_refuses_first(runtime, refusal):
    with pytest.raises(ConfigError, match=refusal):
        parse_config(config_from_inferencenode(inode("kvEvents", runtime)), REPO, environ={})


def test_an_unknown_source_is_refused_by_name():
    with pytest.raises(ConfigError, match="prefixDigestSource: one of served, kvEvents, got 'events'"):
        config_from_inferencenode(inode("events"))
