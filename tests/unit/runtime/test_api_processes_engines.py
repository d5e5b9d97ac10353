"""``server.api_processes`` with several base models (``engines:``): taken, and each engine gets its own
shared engine core's client (docs/api-processes.md)."""

from __future__ import annotations

import pathlib

import pytest

from zerolayer.runtime.apiprocs import ApiProcess, _engine_cores
from zerolayer.runtime.config import build_engine, parse_config
from zerolayer.runtime.errors import ConfigError

TWO = {"engines": [{"kind": "synthetic", "models": ["a"]}, {"kind": "synthetic", "models": ["b"]}],
       "server": {"api_processes": 2}}


def test_several_models_take_several_api_processes():
    config = parse_config(TWO, pathlib.Path("."))
    assert config.api_processes == 2
    assert build_engine(config).models == ("a", "b")


def test_a_client_list_must_match_the_engines():
    config = parse_config(TWO, pathlib.Path("."))
    with pytest.raises(ConfigError, match="1 engine core clients for 2 engines"):
        build_engine(config, [None])
    assert build_engine(config, [None, None]).models == ("a", "b")


def test_synthetic_engines_start_no_engine_core():
    config = parse_config(TWO, pathlib.Path("."))
    cores: list = []
    with _engine_cores(lambda: build_engine(config), 2, cores) as (clients, launched):
        assert (clients, launched, cores) == ([], [], [])
    api = ApiProcess(0, 2, None, "", ())
    assert api.engine_wiring() == {}  # the synthetic engines build on their own in each process
    assert ApiProcess(0, 2, None, "", ("client-a", None)).engine_wiring() == {"core_clients": ("client-a", None)}
