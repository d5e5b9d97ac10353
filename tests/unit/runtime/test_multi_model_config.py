"""``engines:`` (several base models, one engine each), ``loras:``, ``gpus:`` and ``tool_parser``
in the standalone YAML, and the :class:`ModelRouter` that serves them (synthetic engines here;
tests/integration/runtime/test_multi_model_vllm.py runs real vLLM engines and adapters)."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from zerolayer.runtime.config import build_engine, parse_config
from zerolayer.runtime.engine.base import ChatMessage, SamplingOptions
from zerolayer.runtime.engine.router import ModelRouter
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.errors import ConfigError

TENANTS = [{"name": "t", "keys": [{"sha256": "0" * 64}]}]
VLLM = {"kind": "vllm", "model_path": "/w/a", "served_name": "a"}


def parse(**data):  # type: ignore[no-untyped-def]
    return parse_config({"tenants": TENANTS, **data}, pathlib.Path("."), environ={})


def test_engines_build_a_router_with_every_name():
    config = parse(engines=[{"kind": "synthetic", "models": ["a", "a2"]}, {"kind": "synthetic", "models": ["b"]}])
    engine = build_engine(config)
    assert isinstance(engine, ModelRouter) and engine.models == ("a", "a2", "b")
    assert engine.for_model("b") is engine.engines[1] and engine.for_model("a2") is engine.engines[0]


@pytest.mark.parametrize("data, message", [
    ({"engine": {"kind": "synthetic"}, "engines": [{"kind": "synthetic"}]}, "not both"),
    ({"engines": []}, "non-empty list"),
    ({"engines": [{"kind": "synthetic", "models": ["a"]}, {"kind": "synthetic", "models": ["a"]}]},
     "engines[1]: model 'a' is also served by engines[0]"),
    ({"engines": [VLLM, dict(VLLM, served_name="b", loras=[{"name": "a", "path": "/l"}])]},
     "engines[1]: model 'a' is also served by engines[0]"),
    ({"engine": dict(VLLM, loras=[{"name": "x"}])}, "engine.loras[0]: give name and path"),
    ({"engine": dict(VLLM, gpus=[0, 0])}, "distinct GPU indices"),
    ({"engine": dict(VLLM, tool_parser="hermez")}, "did you mean 'hermes'"),
    ({"engines": [dict(VLLM, gpus=[0]), dict(VLLM, served_name="b", gpus=[0])]},
     "engines[0]: shares GPU 0 with engines[1]; give each engine on it gpu_memory_utilization"),
    ({"engines": [dict(VLLM, gpus=[0], gpu_memory_utilization=0.6),
                  dict(VLLM, served_name="b", gpus=[0], gpu_memory_utilization=0.6)]},
     "gpu_memory_utilization 1.2 in all"),
])
def test_bad_engine_lists_are_refused_naming_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        parse(**data)
    assert message in str(err.value)


def test_gpus_set_the_tensor_parallel_size_unless_given():
    from zerolayer.runtime.config import vllm_settings

    assert vllm_settings(dict(VLLM, gpus=[2, 3])).tensor_parallel_size == 2
    assert vllm_settings(dict(VLLM, gpus=[2, 3], tensor_parallel_size=1)).tensor_parallel_size == 1
    shared = parse(engines=[dict(VLLM, gpus=[0], gpu_memory_utilization=0.45),
                            dict(VLLM, served_name="b", gpus=[0], gpu_memory_utilization=0.45)])
    assert [e["served_name"] for e in shared.engines] == ["a", "b"]


def test_router_runs_each_request_on_its_models_engine_and_sums_the_load():
    a, b = SyntheticEngine(("a",), output_tokens=3), SyntheticEngine(("b",), output_tokens=5, max_model_len=64)
    router = ModelRouter([a, b])

    async def run() -> list[int]:
        await router.start()
        counts = []
        for model in ("a", "b"):
            engine = router.for_model(model)
            prompt = await engine.render(model, [ChatMessage("user", "hi")])
            counts.append(sum([d.token_count async for d in engine.generate(prompt, SamplingOptions(16), model, 0)]))
        await router.close()
        return counts

    assert asyncio.run(run()) == [3, 5]
    assert router.context_length("b") == 64 and router.context_length("a") is None
    assert [name for name, _ in router.model_stats()] == ["a", "b"]
    with pytest.raises(ConfigError, match="served by two engines"):
        ModelRouter([SyntheticEngine(("a",)), SyntheticEngine(("a",))])
