"""vLLM's ``lora_int_id`` for each LoRA adapter (engine/lora.py ``adapter_id``): one adapter, one id, in
every API process of a node, whatever order each loads adapters in; two adapters, two ids
(docs/api-processes.md, "LoRA adapters"). The real engine core shared by two API processes:
tests/integration/runtime/test_api_processes_lora_vllm.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

from zerolayer.runtime.engine.lora import LORA_ID_SPACE, AdapterSet, LoraAdapter, adapter_id
from zerolayer.runtime.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[3]
A, B, C = LoraAdapter("sql", "/adapters/sql"), LoraAdapter("chat", "/adapters/chat"), LoraAdapter("x", "/adapters/x")


def clash(path: str) -> tuple[LoraAdapter, LoraAdapter]:
    """Two adapters on folder ``path`` whose ids are equal: names a0, a1, ... until two meet (a
    birthday in 2**31 ids: ~60,000 tries, a tenth of a second)."""
    seen: dict[int, str] = {}
    for i in range(1_000_000):
        name = f"a{i}"
        ident = adapter_id(LoraAdapter(name, path))
        if ident in seen:
            return LoraAdapter(seen[ident], path), LoraAdapter(name, path)
        seen[ident] = name
    raise AssertionError("no two ids met")


def ids(adapters: AdapterSet) -> dict[str, int]:
    """The id of each served adapter's vLLM request (built by ``start_args`` and ``add``)."""
    return {name: adapters.request(name).lora_int_id for name in adapters.names[1:]}


def test_an_adapters_id_is_the_same_in_another_process_with_another_hash_seed():
    code = ("from zerolayer.runtime.engine.lora import LoraAdapter, adapter_id; "
            "print(adapter_id(LoraAdapter('sql', '/adapters/sql')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert int(out) == adapter_id(A)  # Python's hash() of the name would differ here


async def test_ids_do_not_depend_on_the_order_adapters_are_given_in(tmp_path, vllm):
    a, b, c = (folder(tmp_path, x) for x in (A, B, C))
    forward, backward = await started([a, b, c]), await started([c, b, a])
    assert ids(forward) == ids(backward) == {x.name: adapter_id(x) for x in (a, b, c)}
    assert len(set(ids(forward).values())) == 3
    assert all(1 <= i <= LORA_ID_SPACE < 2**31 for i in ids(forward).values())  # vLLM: > 0, in int32


def test_a_new_folder_under_the_same_name_is_a_new_id():
    # vLLM's add_lora keeps the weights it holds under a known id: a new folder must not reuse it.
    assert adapter_id(LoraAdapter("sql", "/adapters/sql-v2")) != adapter_id(A)
    assert adapter_id(LoraAdapter("sql2", "/adapters/sql")) != adapter_id(A)


def test_two_adapters_with_one_id_are_refused_at_start():
    x, y = clash("/p")
    assert adapter_id(x) == adapter_id(y) and x.name != y.name
    with pytest.raises(ConfigError, match=rf"adapter '{y.name}': its LoRA id \d+ .* is that of adapter '{x.name}'"):
        AdapterSet("base", [x, y])


class RecordingEngine:
    """The two calls AdapterSet makes on vLLM's AsyncLLM, recorded (the shared engine core's own
    behaviour is the integration test's)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def add_lora(self, request) -> None:
        self.calls.append(("add", request.lora_int_id))

    async def remove_lora(self, lora_id: int) -> None:
        self.calls.append(("remove", lora_id))


def folder(tmp_path: pathlib.Path, adapter: LoraAdapter) -> LoraAdapter:
    where = tmp_path / adapter.path.strip("/").replace("/", "_")
    where.mkdir(exist_ok=True)
    (where / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return LoraAdapter(adapter.name, str(where))


@pytest.fixture
def vllm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="the vllm engine extra is not installed")


async def started(adapters: list[LoraAdapter]) -> AdapterSet:
    lora = AdapterSet("base", adapters)
    lora.start_args({"enable_lora": True})
    return lora


async def test_two_processes_adding_adapters_in_other_orders_agree_on_every_id(tmp_path, vllm):
    a, b, c = (folder(tmp_path, x) for x in (A, B, C))
    first, second = await started([a]), await started([a])  # two API processes, one config
    one, two = RecordingEngine(), RecordingEngine()
    for adapter in (b, c):
        await first.add(one, adapter)
    for adapter in (c, b):
        await second.add(two, adapter)
    assert ids(first) == ids(second)
    assert {n: first.request(n).lora_int_id for n in "sql chat x".split()} == ids(first)
    assert sorted(one.calls) == sorted(two.calls) == sorted(("add", adapter_id(x)) for x in (b, c))


async def test_a_removed_adapter_added_again_gets_its_id_back_and_a_clash_is_refused_live(
        tmp_path, monkeypatch, vllm):
    a = folder(tmp_path, A)
    lora, engine = await started([a]), RecordingEngine()
    await lora.remove(engine, "sql")
    await lora.add(engine, a)
    assert engine.calls == [("remove", adapter_id(a)), ("add", adapter_id(a))]
    monkeypatch.chdir(tmp_path)  # the clashing pair's folder is the relative path "p"
    x, y = clash("p")
    folder(tmp_path, LoraAdapter("p", "p"))
    await lora.add(engine, x)
    with pytest.raises(ConfigError, match="rename one of them"):
        await lora.add(engine, y)
    assert engine.calls[-1] == ("add", adapter_id(x)) and y.name not in lora.names
    assert lora.request(x.name).lora_int_id == adapter_id(x)
