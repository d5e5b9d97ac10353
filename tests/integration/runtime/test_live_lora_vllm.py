"""LoRA adapters added to and removed from a running runtime, with real vLLM on the CPU (issue 25).

The runtime is built from an InferenceNode the way the operator's pod builds it
(``config_from_inferencenode``), serving the tiny model with one adapter. The test then edits that
InferenceNode's adapters and hands each new version to the runtime's own spec sync
(``NodeSpecSync.apply`` with ``sync_adapters`` over the server's engine, as ``compose.py`` wires
it): an added adapter is loaded through vLLM's dynamic LoRA and served under its name with its own
weights; a removed one is refused by name; the engine (and so the process) never restarts.
"""

from __future__ import annotations

import copy
import pathlib
from typing import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from runtime_helpers import KEY, start_runtime, tenants
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = [*vllm_marks(timeout=400), pytest.mark.asyncio(loop_scope="session")]
REPO = pathlib.Path(__file__).resolve().parents[3]
PROMPT = "The quick brown fox"
BASE, FIRST, SECOND = "tiny", "tiny-first", "tiny-second"


def inference_node(generation: int, adapters: dict[str, pathlib.Path], model: pathlib.Path) -> dict:
    return {"metadata": {"name": "node-a", "generation": generation},
            "spec": {"nodeName": "node-a",
                     "models": [{"name": BASE, "source": {"path": str(model)}, "maxModelLen": 512,
                                 "loras": [{"name": n, "source": {"path": str(p)}} for n, p in adapters.items()]}],
                     "runtime": {"engine": "vllm", "gpus": 0, "kvCacheBytes": 32 * 1024 * 1024, "maxNumSeqs": 4,
                                 "enforceEager": True, "dtype": "float32"}}}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, pathlib.Path]:
    from zerolayer.runtime.node import tinymodel

    base = tinymodel.generate(REPO / ".models" / "tiny-llama")
    root = tmp_path_factory.mktemp("live-lora")
    # Larger weights than the default scale, so greedy decoding shows which set ran (see
    # test_multi_model_vllm.py: at the default scale every set only echoes the prompt).
    return {"base": base, FIRST: tinymodel.generate_lora(base, root / FIRST, seed=1, scale=0.5),
            SECOND: tinymodel.generate_lora(base, root / SECOND, seed=2, scale=0.5)}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def node(weights) -> AsyncIterator:
    from zerolayer.runtime.config import build_engine, parse_config
    from zerolayer.runtime.node.incluster import NodeSpecSync, config_from_inferencenode, sync_adapters

    first = inference_node(1, {FIRST: weights[FIRST]}, weights["base"])
    config = parse_config(config_from_inferencenode(first), REPO)
    engine = build_engine(config)
    async with start_runtime(engine=engine, tenants=tenants(), sample_interval_s=0.05) as server:
        sync = NodeSpecSync(None, "node-a", {}, lambda marks: None,
                            load_adapters=lambda wanted: sync_adapters(server.engine, wanted))
        sync.prime(first)
        server.spec_sync = sync  # type: ignore[attr-defined]
        server.first = first  # type: ignore[attr-defined]
        yield server


async def greedy(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True})


async def test_an_adapter_added_to_the_inferencenode_is_served_and_a_removed_one_refused(node, weights):
    engine = node.engine
    llm = engine._llm  # the one AsyncLLM: it must be the same object at the end (no restart)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=node.base_url, headers=headers, timeout=120) as client:
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert listed == [BASE, FIRST]
        before = {m: (await greedy(client, m)).json()["choices"][0]["text"] for m in (BASE, FIRST)}
        missing = await greedy(client, SECOND)
        assert missing.status_code == 404 and SECOND in missing.text

        added = inference_node(2, {FIRST: weights[FIRST], SECOND: weights[SECOND]}, weights["base"])
        assert await node.spec_sync.apply(copy.deepcopy(added)) is True
        assert node.spec_sync.restart_needed == [] and node.spec_sync.adapter_failures == []
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [BASE, FIRST, SECOND]
        assert models[2]["parent"] == BASE and models[2]["root"] == str(weights[SECOND])
        second = await greedy(client, SECOND)
        assert second.status_code == 200 and second.json()["model"] == SECOND
        assert second.json()["usage"]["completion_tokens"] == 12
        texts = {**before, SECOND: second.json()["choices"][0]["text"]}
        assert len(set(texts.values())) == 3, texts  # the new adapter runs with its own weights
        assert (await greedy(client, FIRST)).json()["choices"][0]["text"] == before[FIRST]

        removed = inference_node(3, {SECOND: weights[SECOND]}, weights["base"])
        assert await node.spec_sync.apply(copy.deepcopy(removed)) is True
        refused = await greedy(client, FIRST)
        assert refused.status_code == 404 and FIRST in refused.json()["error"]["message"]
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [BASE, SECOND]
        assert (await greedy(client, SECOND)).json()["choices"][0]["text"] == texts[SECOND]
        assert (await greedy(client, BASE)).json()["choices"][0]["text"] == before[BASE]
    assert engine._llm is llm and engine.ready()
    assert node.spec_sync.restart_needed == []


async def test_an_adapter_above_the_engines_rank_is_refused_and_nothing_else_changes(node, weights, tmp_path):
    from zerolayer.runtime.node import tinymodel

    big = tinymodel.generate_lora(weights["base"], tmp_path / "tiny-wide", rank=64)
    current = {a.name: pathlib.Path(a.path) for a in node.engine.lora.adapters}
    wanted = inference_node(10, {**current, "tiny-wide": big}, weights["base"])
    assert await node.spec_sync.apply(wanted) is False
    [failure] = node.spec_sync.adapter_failures
    assert failure.startswith("tiny-wide: ") and "rank 64 is above the engine's max_lora_rank 16" in failure
    assert "tiny-wide" not in node.engine.models and list(current) == [a.name for a in node.engine.lora.adapters]
