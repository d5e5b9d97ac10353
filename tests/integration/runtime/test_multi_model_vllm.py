"""Several base models and a LoRA adapter on one runtime, with real vLLM on the CPU.

The node is described as a user writes it (``engines:`` in the standalone YAML, loaded by
``load_config`` and built by ``build_engine``): two tiny models with different random weights, one
engine each, and a LoRA adapter (random A/B matrices, PEFT layout) on the first. The official SDKs
then reach each by name.

What random weights can show: that a request runs on the model it names. Greedy decoding
(temperature 0) of one prompt gives one token sequence per set of weights, and the three sets here
(base A, A with the adapter, base B) give three different sequences, while asking the same model twice
gives the same one. At the tiny model's default weight scale greedy decoding only echoes the prompt's
last token, whatever the seed, so B and the adapter are written with larger weights (``init_std``).
They cannot show that an adapter makes a model better at anything.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import yaml
from runtime_helpers import KEY, start_runtime
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=400), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
PROMPT = "The quick brown fox"
ENGINE = {"kind": "vllm", "max_model_len": 512, "max_num_seqs": 4, "kv_cache_memory_bytes": 32 * 1024 * 1024,
          "enforce_eager": True, "dtype": "float32"}


@pytest.fixture(scope="module")
def node_config(tmp_path_factory) -> pathlib.Path:
    from zerolayer.runtime.node import tinymodel

    base_a = tinymodel.generate(REPO / ".models" / "tiny-llama")
    root = tmp_path_factory.mktemp("multi")
    base_b = tinymodel.generate(root / "tiny-b", seed=7, init_std=0.5)  # same shape, weights that are its own
    adapter = tinymodel.generate_lora(base_a, root / "tiny-a-sql")
    config = {
        "engines": [
            {**ENGINE, "model_path": str(base_a), "served_name": "tiny-a",
             "loras": [{"name": "tiny-a-sql", "path": str(adapter)}]},
            {**ENGINE, "model_path": str(base_b), "served_name": "tiny-b"},
        ],
        "tenants": [{"name": "acme", "keys": [{"env": "ZL_TEST_KEY"}]}],
    }
    path = root / "node.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(node_config) -> AsyncIterator:
    from zerolayer.runtime.config import build_engine, load_config

    config = load_config(node_config, environ={"ZL_TEST_KEY": KEY})
    engine = build_engine(config)
    metered: list[tuple[str, str, int]] = []

    def sink(tenant: str, request_id: str, model: str, input_tokens: int, output_tokens: int, first: bool) -> None:
        metered.append((model, request_id, output_tokens))

    async with start_runtime(engine=engine, tenants=config.tenants, token_sink=sink,
                             sample_interval_s=0.05) as running:
        running.metered = metered  # type: ignore[attr-defined]
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def oai(server):  # type: ignore[no-untyped-def]
    import openai

    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


async def _greedy(oai, model: str) -> str:  # type: ignore[no-untyped-def]
    out = await oai.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert out.model == model and out.usage.completion_tokens == 12
    return out.choices[0].text


async def test_models_lists_base_models_and_the_adapter_with_its_parent(oai) -> None:
    listed = {m.id: m for m in (await oai.models.list()).data}
    assert list(listed) == ["tiny-a", "tiny-a-sql", "tiny-b"]
    assert listed["tiny-a-sql"].parent == "tiny-a"
    assert listed["tiny-a"].parent is None and listed["tiny-b"].parent is None


async def test_each_model_answers_with_its_own_weights(oai, server) -> None:
    texts = {model: await _greedy(oai, model) for model in ("tiny-a", "tiny-a-sql", "tiny-b")}
    assert len(set(texts.values())) == 3, texts  # three sets of weights, three greedy answers
    assert await _greedy(oai, "tiny-a-sql") == texts["tiny-a-sql"]  # and each is the model's own, every time
    assert await _greedy(oai, "tiny-b") == texts["tiny-b"]
    billed = {model for model, _, _ in server.metered}
    assert {"tiny-a", "tiny-a-sql", "tiny-b"} <= billed  # metered (and so billed) under the name asked for


async def test_chat_through_the_anthropic_sdk_reaches_the_adapter(server) -> None:
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=KEY, max_retries=0) as client:
        reply = await client.messages.create(model="tiny-a-sql", max_tokens=8,
                                             messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "tiny-a-sql" and reply.usage.output_tokens >= 1


async def test_unknown_model_is_a_404_naming_the_served_ones(oai) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        await oai.completions.create(model="tiny-c", prompt=PROMPT, max_tokens=4)
    assert "tiny-a-sql" in str(err.value) and "tiny-b" in str(err.value)


async def test_metrics_per_model_and_lora_requests_info_while_the_adapter_runs(oai, server) -> None:
    stream = await oai.completions.create(model="tiny-a-sql", prompt=PROMPT, max_tokens=400, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    seen = ""
    async with httpx.AsyncClient() as http:
        async for _chunk in stream:
            text = (await http.get(server.base_url + "/metrics")).text
            if 'running_lora_adapters="tiny-a-sql"' in text:
                seen = text
                break
            await asyncio.sleep(0.02)
        await stream.close()
    assert seen, "vllm:lora_requests_info never showed the adapter running"
    assert 'vllm:lora_requests_info{max_lora="1",model_name="tiny-a",running_lora_adapters="tiny-a-sql"' in seen
    for model in ("tiny-a", "tiny-b"):
        assert f'vllm:num_requests_running{{model_name="{model}"}}' in seen
        assert f'vllm:kv_cache_usage_perc{{model_name="{model}"}}' in seen
