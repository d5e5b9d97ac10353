"""Standalone config: the shipped examples load; mistakes name the key."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from zerolayer.runtime.config import build_server, load_config, parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.tenants import key_hash

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_standalone_example_loads_and_builds():
    config = load_config(REPO / "examples" / "standalone.yaml", environ={})
    assert config.engine["kind"] == "synthetic"
    assert {t.name for t in config.tenants} == {"demo", "batch"}
    demo = next(t for t in config.tenants if t.name == "demo")
    assert key_hash("sk-zerolayer-demo") in demo.key_hashes
    server = build_server(config, port=0)
    assert server.engine.kind == "synthetic"


def test_vllm_example_parses_without_starting_anything():
    config = load_config(REPO / "examples" / "standalone-vllm.yaml", environ={})
    assert config.engine["kind"] == "vllm" and config.engine["model_path"]


def test_env_keys_are_hashed_at_load():
    data = {"tenants": [{"name": "t", "keys": [{"env": "MY_KEY"}]}]}
    config = parse_config(data, REPO, environ={"MY_KEY": "sk-secret"})
    assert config.tenants[0].key_hashes == frozenset({key_hash("sk-secret")})


@pytest.mark.parametrize(
    "data, where",
    [
        ({"tenants": [{"name": "t", "keys": [{"env": "UNSET"}]}]}, "tenants[0].keys[0].env"),
        ({"tenants": [{"name": "t", "keys": [{"sha256": "abc"}]}]}, "tenants[0].keys[0].sha256"),
        ({"tenants": [{"name": "t", "keys": []}]}, "tenants[0].keys"),
        ({"tenants": [{"name": "t", "keys": [{"sha256": "0" * 64}], "priorities": ["urgent"]}]},
         "tenants[0].priorities"),
        ({"engine": {"kind": "tpu"}}, "engine.kind"),
        ({"engine": {"kind": "vllm"}}, "engine.model_path"),
        ({"listen": {"port": 70000}}, "listen.port"),
        ({"limits": {"max_header_count": 0}}, "limits.max_header_count"),
        ({"limits": {"max_headers": 5}}, "unknown limits"),
        ({"gpu": {"source": "tpu"}}, "gpu.source"),
        ({"listne": {}}, "unknown top-level keys"),
    ],
)
def test_mistakes_name_the_key(data, where):
    with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(where)):
        parse_config(data, REPO, environ={})


def test_scheduler_mistakes_are_config_errors():
    config = parse_config({"scheduler": {"low_shed_at": 2}}, REPO, environ={})
    with pytest.raises(ConfigError, match="scheduler"):
        build_server(config)


def test_examples_are_valid_yaml_with_no_plain_keys():
    for path in REPO.glob("examples/*standalone*.yaml"):
        text = path.read_text()
        yaml.safe_load(text)
        assert "sk-zerolayer-demo\n" not in text.replace('"sk-zerolayer-demo"', "")


def test_required_headers_setting():
    config = parse_config({"headers": {"required": ["session", "deadline"]}}, REPO, environ={})
    assert config.required_headers == ("session", "deadline")
    with pytest.raises(ConfigError, match="headers.required"):
        parse_config({"headers": {"required": ["colour"]}}, REPO, environ={})
