"""LoRA adapters with ``server.api_processes: 2``, real tiny vLLM on the CPU (docs/api-processes.md,
"LoRA adapters").

Static adapters: the node started from the CLI with ``--api-processes 2`` and one adapter, and two
HTTP/2 clients, which exact connection balance hands one to each API process; both list the adapter
and run it with the same weights.

Adapters added and removed while running: each API process runs its own InferenceNode watcher
(``NodeSpecSync`` with ``sync_adapters``, as compose.py wires every process). Here two API clients of
one shared engine core (``SharedEngineCore``, the parent's launcher) live in the test process, each
with its own server and spec sync, fed InferenceNode versions as each process's watch would: one
process sees an intermediate version the other skips, and the adapters end up in a different order
in each. A per-process id counter would give the second process's new adapter the id the engine core
already holds for another adapter, and that process would serve the other adapter's weights.
"""

from __future__ import annotations

import copy
import pathlib
from typing import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from apiprocs_helpers import KEY as NODE_KEY
from apiprocs_helpers import Node, free_port, per_process, write_config
from runtime_helpers import KEY, start_runtime, tenants
from tests.vllm_marks import require_vllm, vllm_marks

require_vllm()

pytestmark = vllm_marks(timeout=500)
REPO = pathlib.Path(__file__).resolve().parents[3]
PROMPT = "The quick brown fox"
BASE, FIRST, SECOND, THIRD = "tiny", "tiny-first", "tiny-second", "tiny-third"


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, pathlib.Path]:
    from zerolayer.runtime.node import tinymodel

    base = tinymodel.generate(REPO / ".models" / "tiny-llama")
    root = tmp_path_factory.mktemp("apiprocs-lora")
    # Larger weights than the default scale, so greedy decoding shows which set ran (test_live_lora_vllm.py).
    return {"base": base, **{name: tinymodel.generate_lora(base, root / name, seed=seed, scale=0.5)
                             for seed, name in enumerate((FIRST, SECOND, THIRD), start=1)}}


def completion(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_both_api_processes_list_and_run_a_static_adapter(tmp_path, weights) -> None:
    port = free_port()
    engine = {"kind": "vllm", "model_path": str(weights["base"]), "served_name": BASE, "max_model_len": 512,
              "max_num_seqs": 4, "kv_cache_memory_bytes": 32 * 1024 * 1024, "enforce_eager": True,
              "dtype": "float32", "loras": [{"name": FIRST, "path": str(weights[FIRST])}]}
    node = Node(write_config(tmp_path, engine, port), port, 2, ready_s=300)
    try:
        # Two clients, each one connection for all its requests; the second connection goes to the
        # process without one (server.connection_balance: exact, the default).
        clients = [httpx.Client(http1=False, http2=True, timeout=120, base_url=node.url,
                                headers={"authorization": f"Bearer {NODE_KEY}"}) for _ in range(2)]
        try:
            listed = [[m["id"] for m in client.get("/v1/models").json()["data"]] for client in clients]
            texts = []
            for client in clients:
                answers = {m: client.post("/v1/completions", json=completion(m)) for m in (BASE, FIRST)}
                assert all(r.status_code == 200 and r.http_version == "HTTP/2" for r in answers.values()), answers
                texts.append({m: r.json()["choices"][0]["text"] for m, r in answers.items()})
        finally:
            for client in clients:
                client.close()
        page = node.metrics()
    finally:
        status = node.stop()
    assert status == 0, node.output()
    assert listed == [[BASE, FIRST], [BASE, FIRST]]
    assert per_process(page, "zerolayer_requests_total", 'route="models"', 'status="200"') == {"0": 1.0, "1": 1.0}
    assert per_process(page, "zerolayer_requests_total", 'route="completions"', 'status="200"') == {"0": 2.0,
                                                                                                       "1": 2.0}
    assert texts[0] == texts[1] and texts[0][BASE] != texts[0][FIRST], texts  # one adapter, its own weights


# ------------------------------------------------------------------ adapters added and removed live
def inference_node(generation: int, adapters: list[str], weights: dict[str, pathlib.Path]) -> dict:
    return {"metadata": {"name": "node-a", "generation": generation},
            "spec": {"nodeName": "node-a",
                     "models": [{"name": BASE, "source": {"path": str(weights["base"])}, "maxModelLen": 512,
                                 "loras": [{"name": n, "source": {"path": str(weights[n])}} for n in adapters]}],
                     "runtime": {"engine": "vllm", "gpus": 0, "kvCacheBytes": 32 * 1024 * 1024, "maxNumSeqs": 4,
                                 "enforceEager": True, "dtype": "float32",
                                 # room for every adapter at once, so the engine core's list shows them all
                                 "engineArgs": {"max_loras": 4}}}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def processes(weights) -> AsyncIterator[list]:
    """Two API processes' servers and spec syncs, clients 0 and 1 of one engine core."""
    from zerolayer.runtime.config import build_engine, parse_config
    from zerolayer.runtime.engine.shared_core import SharedEngineCore
    from zerolayer.runtime.node.incluster import NodeSpecSync, config_from_inferencenode, sync_adapters

    first = inference_node(1, [FIRST], weights)
    config = parse_config(config_from_inferencenode(first), REPO)
    core = SharedEngineCore(build_engine(config), 2)
    try:
        with core.launch() as (clients, _):
            pass  # leaving the block waits for the engine core
        engines = [build_engine(config, [client]) for client in clients]
        async with start_runtime(engine=engines[0], tenants=tenants(), sample_interval_s=0.05) as one, \
                start_runtime(engine=engines[1], tenants=tenants(), sample_interval_s=0.05) as two:
            for server in (one, two):
                sync = NodeSpecSync(None, "node-a", {}, lambda marks: None,
                                    load_adapters=lambda wanted, s=server: sync_adapters(s.engine, wanted))
                sync.prime(first)
                server.spec_sync = sync  # type: ignore[attr-defined]
            yield [one, two]
    finally:
        core.shutdown(timeout=10)


async def served(server, model: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, headers={"authorization": f"Bearer {KEY}"},
                                 timeout=120) as client:
        return await client.post("/v1/completions", json=completion(model))


async def listed(server) -> list[str]:
    async with httpx.AsyncClient(base_url=server.base_url, headers={"authorization": f"Bearer {KEY}"}) as client:
        return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]


async def text(server, model: str) -> str:
    response = await served(server, model)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def apply(server, inode: dict) -> None:
    assert await server.spec_sync.apply(copy.deepcopy(inode)) is True
    assert server.spec_sync.adapter_failures == [] and server.spec_sync.restart_needed == []


@pytest.mark.asyncio(loop_scope="session")
async def test_adapters_added_and_removed_live_reach_both_api_processes(processes, weights) -> None:
    from zerolayer.runtime.engine.lora import LoraAdapter, adapter_id

    one, two = processes
    llms = [one.engine._llm, two.engine._llm]
    assert await listed(one) == await listed(two) == [BASE, FIRST]
    before = {m: await text(one, m) for m in (BASE, FIRST)}
    assert {m: await text(two, m) for m in (BASE, FIRST)} == before

    # Process 0's watch sees generation 2 (SECOND added), then 3 (FIRST removed, THIRD added, listed
    # first); process 1's sees only 3: each process loads the new adapters in another order.
    await apply(one, inference_node(2, [FIRST, SECOND], weights))
    assert SECOND in await listed(one) and (await served(two, SECOND)).status_code == 404  # not yet its
    latest = inference_node(3, [THIRD, SECOND], weights)
    await apply(one, latest)
    assert (await served(one, FIRST)).status_code == 404
    # Process 1 has not seen generation 3 yet: it still serves FIRST, on its own weights, although
    # process 0 unloaded it from the engine core (vLLM loads it again for the request that carries it).
    assert await text(two, FIRST) == before[FIRST]
    await apply(two, latest)

    for server in (one, two):
        assert sorted(await listed(server)) == sorted([BASE, SECOND, THIRD])
        refused = await served(server, FIRST)
        assert refused.status_code == 404 and FIRST in refused.json()["error"]["message"]
    texts = [{m: await text(server, m) for m in (BASE, SECOND, THIRD)} for server in (one, two)]
    assert texts[0] == texts[1], texts  # one adapter, one id, one set of weights on the engine core
    assert texts[0][BASE] == before[BASE] and len({*texts[0].values(), before[FIRST]}) == 4, texts
    # The engine core holds each served adapter once, under the id both processes gave it.
    ids = {n: adapter_id(LoraAdapter(n, str(weights[n]))) for n in (SECOND, THIRD)}
    assert {n: one.engine.lora.request(n).lora_int_id for n in ids} == ids
    assert {n: two.engine.lora.request(n).lora_int_id for n in ids} == ids
    assert set(await llms[0].list_loras()) == set(await llms[1].list_loras()) == set(ids.values())
    assert [one.engine._llm, two.engine._llm] == llms  # nothing restarted
